/* What the bindings ask of the formats: block sizes, how many formats this build knows, and the build's
   variant. */
#include "blocks.h"
#include "qmatmul.h"

int qmm_block_bytes(int fmt) { return BLOCK_BYTES[fmt]; }
int qmm_format_count(void) { return N_FORMATS; } /* format ids 0 .. count - 1 are known to this build */
int qmm_block_values(int fmt) { return BLOCK_VALUES[fmt]; }

#if defined(QMM_VNNI)
const char *qmm_variant(void) { return "avx512vnni"; }
#elif defined(QMM_AVX2)
const char *qmm_variant(void) { return "avx2"; }
#elif defined(QMM_NEON) && defined(__ARM_FEATURE_DOTPROD)
const char *qmm_variant(void) { return "neondot"; }
#elif defined(QMM_NEON)
const char *qmm_variant(void) { return "neon"; }
#else
const char *qmm_variant(void) { return "scalar"; }
#endif

