/* Runs many tiny jobs on kernels/cpu/src/pool.c and counts every task that did not run exactly once before its
   pool_run returned, or ran with an index past its own job's task count: a late worker taking a task of the
   wrong job shows up here (and, in the model, as a use of a dead stack context). Prints the anomaly count. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "pool.h"

void qmm_set_threads(int n);

typedef struct {
    atomic_int *hits;
    int n;
    atomic_long *strays;
} job_t;

static void task(void *ctx, int i) {
    job_t *j = ctx;
    if (i >= j->n) {
        atomic_fetch_add(j->strays, 1);
        return;
    }
    atomic_fetch_add(&j->hits[i], 1);
}

int main(int argc, char **argv) {
    long jobs = atol(argv[1]), bad = 0;
    static atomic_long strays = 0;
    qmm_set_threads(atoi(argv[2]));
    for (long k = 0; k < jobs; k++) {
        atomic_int hits[16] = {0};
        job_t j = {hits, 2 + (int)(k % 7), &strays};
        pool_run(task, &j, j.n, 1);
        for (int i = 0; i < j.n; i++) bad += atomic_load(&hits[i]) != 1;
    }
    printf("%ld\n", bad + atomic_load(&strays));
    return 0;
}
