/* A small persistent pthread pool: the caller and up to n - 1 workers take tasks from a shared counter.

   The counter holds (job generation << 32 | next task), so a worker that wakes late for a finished job can never
   take a task of the next one by mistake; the caller waits only for tasks that were actually taken, never for a
   worker the OS has not scheduled yet (on a busy machine that wait would cost a whole time slice per call).
   Workers spin briefly between jobs (a decode step calls in every few microseconds), yielding now and then, and
   sleep on a condition variable when nothing comes. */

#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#define MAX_THREADS 64
static int n_workers = 0;
static void (*job_fn)(void *, int);
static void *job_ctx;
static int job_tasks;
static atomic_uint_fast64_t counter = 0; /* generation << 32 | next task index */
static atomic_int done = 0;              /* tasks of the current job finished */
static atomic_uint generation = 0;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

enum { SPIN = 20000, YIELD_EVERY = 256 };
#define CLOSED 0x7fffffffu /* a task index no job reaches */

/* Take and run tasks of generation `gen` until none is left; returns how many this thread ran. */
static void take_tasks(uint32_t gen) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&counter, memory_order_acquire);
        if ((uint32_t)(v >> 32) != gen || (int)(uint32_t)v >= job_tasks) return;
        if (!atomic_compare_exchange_weak_explicit(&counter, &v, v + 1, memory_order_acq_rel, memory_order_acquire))
            continue;
        job_fn(job_ctx, (int)(uint32_t)v);
        atomic_fetch_add_explicit(&done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    for (;;) {
        int spins = 0;
        uint32_t gen;
        while ((gen = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            if (++spins < SPIN) {
                if (spins % YIELD_EVERY == 0) sched_yield();
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool_lock);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&pool_wake, &pool_lock);
            pthread_mutex_unlock(&pool_lock);
        }
        seen = gen;
        take_tasks(gen);
    }
    return 0;
}

/* Use `n` threads (the caller plus n - 1 workers) from now on; workers are only ever added. */
void qmm_set_threads(int n) {
    pthread_mutex_lock(&call_lock);
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (n_workers < n - 1) {
        pthread_t t;
        if (pthread_create(&t, 0, worker_main, (void *)(uintptr_t)atomic_load(&generation)) != 0) break;
        pthread_detach(t);
        n_workers++;
    }
    pthread_mutex_unlock(&call_lock);
}

int pool_threads(void) { return n_workers + 1; }

void pool_run(void (*fn)(void *, int), void *ctx, int n_tasks, int parallel) {
    pthread_mutex_lock(&call_lock);
    if (!parallel || n_workers == 0 || n_tasks < 2) {
        for (int i = 0; i < n_tasks; i++) fn(ctx, i);
        pthread_mutex_unlock(&call_lock);
        return;
    }
    uint32_t gen = atomic_load(&generation) + 1;
    /* Close the counter under the new generation before touching the job's fields: a worker still holding a
       counter value of the last job (preempted between its load and its compare-exchange) must fail that
       exchange, not pass it against this job's task count and then run a task of this job, or of the last one
       with this job's context. */
    atomic_store_explicit(&counter, (uint64_t)gen << 32 | CLOSED, memory_order_seq_cst);
    job_fn = fn;
    job_ctx = ctx;
    job_tasks = n_tasks;
    atomic_store(&done, 0);
    atomic_store_explicit(&counter, (uint64_t)gen << 32, memory_order_release);
    pthread_mutex_lock(&pool_lock);
    atomic_store_explicit(&generation, gen, memory_order_release);
    pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_lock);
    take_tasks(gen);
    int spins = 0;
    while (atomic_load_explicit(&done, memory_order_acquire) < n_tasks) {
        if (++spins % YIELD_EVERY == 0) sched_yield();
        cpu_relax();
    }
    pthread_mutex_unlock(&call_lock);
}
