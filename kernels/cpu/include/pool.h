/* A small persistent pthread pool (no OpenMP, so no second OpenMP runtime next to torch's). */
#pragma once
#include <stdint.h>

/* Run fn(ctx, i) for i in 0..n_tasks-1 on the calling thread and (when `parallel`) the pool's workers. */
void pool_run(void (*fn)(void *, int), void *ctx, int n_tasks, int parallel);

/* Threads a job runs on: the caller plus the workers. */
int pool_threads(void);
/* Use `n` threads (the caller plus n - 1 workers) from now on. */
void qmm_set_threads(int n);
