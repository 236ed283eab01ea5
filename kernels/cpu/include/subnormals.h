/* Subnormal floats flushed to zero on this thread for one kernel task (x86: MXCSR's FTZ and DAZ; elsewhere nothing):
   a recurrent state that decays toward zero fills with subnormals, and each multiply on one is a microcode assist
   (the gated delta rule 2-6x slower on such states: docs/perf-log/2026-11-to-12.md, 2026-12-04). Values below
   1.2e-38 are then read and written as zero. The thread's mode is put back after the task, so torch's own ops on the
   calling thread keep theirs. */
#pragma once
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned fp_mode_t;
static inline fp_mode_t subnormals_off(void) {
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ (bit 15) | DAZ (bit 6) */
    return csr;
}
static inline void fp_mode_restore(fp_mode_t mode) { _mm_setcsr(mode); }
#else
typedef int fp_mode_t;
static inline fp_mode_t subnormals_off(void) { return 0; }
static inline void fp_mode_restore(fp_mode_t mode) { (void)mode; }
#endif
