/* A small persistent pthread pool: the caller and up to n - 1 workers take tasks from a shared counter.
   Workers spin briefly between jobs (a decode step calls in every few microseconds), then sleep. */

#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

typedef struct {
    void (*fn)(void *, int);
    void *ctx;
    int n_tasks;
    atomic_int next;
} pool_job_t;

#define MAX_THREADS 64
static pthread_t workers[MAX_THREADS];
static int n_workers = 0;
static pool_job_t *volatile current = 0;
static atomic_int generation = 0, pending = 0;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

enum { SPIN = 200000 };

static void take_tasks(pool_job_t *j) {
    for (;;) {
        int i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n_tasks) break;
        j->fn(j->ctx, i);
    }
}

static void *worker_main(void *arg) {
    int seen = (int)(intptr_t)arg; /* the generation when this worker was made: it must not miss the next */
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            if (++spins < SPIN) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool_lock);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&pool_wake, &pool_lock);
            pthread_mutex_unlock(&pool_lock);
        }
        seen = atomic_load(&generation);
        take_tasks(current);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return 0;
}

/* Use `n` threads (the caller plus n - 1 workers) from now on; workers are only ever added. */
void qmm_set_threads(int n) {
    pthread_mutex_lock(&call_lock);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (n_workers < n - 1) {
        if (pthread_create(&workers[n_workers], 0, worker_main, (void *)(intptr_t)atomic_load(&generation)) != 0)
            break;
        pthread_detach(workers[n_workers]);
        n_workers++;
    }
    pthread_mutex_unlock(&call_lock);
}

void pool_run(void (*fn)(void *, int), void *ctx, int n_tasks, int parallel) {
    pool_job_t job;
    job.fn = fn;
    job.ctx = ctx;
    job.n_tasks = n_tasks;
    atomic_init(&job.next, 0);
    pthread_mutex_lock(&call_lock);
    int wake = parallel && n_workers > 0 && n_tasks > 1;
    if (wake) {
        current = &job;
        atomic_store(&pending, n_workers);
        pthread_mutex_lock(&pool_lock);
        atomic_fetch_add_explicit(&generation, 1, memory_order_release);
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_lock);
    }
    take_tasks(&job);
    if (wake)
        while (atomic_load_explicit(&pending, memory_order_acquire) > 0) cpu_relax();
    pthread_mutex_unlock(&call_lock);
}
