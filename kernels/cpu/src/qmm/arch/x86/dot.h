/* The two halves of arch/x86's qmm_dot_block: weight rows in the GGUF or _R8 layout, and _X8 bands. */
#pragma once
#include "../../blocks.h"

/* GGUF / _R8 rows [n0, n1): groups of 4 activation rows two (or one) weight rows at a time, then the rest one
   at a time */
void qmm_dot_rows(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr, float *out,
                  int64_t ldo);
/* _X8 bands (n0, n1: multiples of 8), every tile of activation rows over each band (two bands at a time where
   VNNI's 16-lane pass takes them) */
void qmm_dot_bands(int fmt, const uint8_t *w, int64_t row_bytes, int n0, int n1, int K, act_t a, int nr, float *out,
                  int64_t ldo);
