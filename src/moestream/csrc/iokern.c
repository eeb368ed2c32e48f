/* Expert reads on C threads: pread(2) into slot memory without the Python interpreter (experts/reader.py).
 *
 * A reader (ms_io_new) owns a table of job entries and n threads. A job reads `len` bytes at `off` into `dst`:
 * the first pread through `dfd` (O_DIRECT) when it is >= 0, the rest (a short direct read at the end of the file)
 * through the buffered `fd`, as ExpertReader._fill does; then fstat(fd) is compared with the file's identity
 * (st_dev, st_ino, st_size, st_mtime in ns) the model was loaded with. The outcome is left in the entry for the
 * Python side, which raises the same errors as its own threads would (ExpertReadError, ModelFileChanged) and handles
 * an O_DIRECT read the kernel refuses (EINVAL) by reading it again buffered.
 *
 * Two queues: demand reads (priority 0) are taken first; a low-priority read (1, a speculative prefetch) starts only
 * when no demand read is queued or running, and at most `low_max` of them run at once, so a wrong guess never holds
 * a demand read back by more than the low reads already running. A queued read can be cancelled.
 *
 * Entries go back to the free list when the Python side has taken the outcome (ms_io_release); an entry released
 * while its read runs is freed by the thread when it finishes.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { ST_FREE = 0, ST_QUEUED = 1, ST_RUNNING = 2, ST_DONE = 3, ST_CANCELLED = 4 };
/* outcome codes (ms_io_result) */
enum { OUT_OK = 0, OUT_ERRNO = 1, OUT_REFUSED = 2, OUT_CHANGED = 3 };

typedef struct {
    int fd, dfd, prio, state, outcome, err, orphan, buffered_rest;
    int next; /* queue or free list link */
    int64_t off, len, done;
    int64_t t_start, t_end; /* CLOCK_MONOTONIC ns around the read (diagnostics: tools/profile_capped.py) */
    char *dst;
    int64_t id_dev, id_ino, id_size, id_mtime;
    unsigned gen;
} io_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, fin;
    pthread_t *th;
    int n_threads, stop;
    io_job *jobs;
    int n_jobs, free_head;
    int qh[2], qt[2]; /* queue heads/tails per priority */
    int running[2];
    int low_max;
    int64_t low_chunk;
} io_reader;

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Read the job's bytes from j->done on: all of them, or (chunk > 0) at most `chunk` bytes, then return. Returns 1 when
 * the job is finished (read, or failed: outcome set), 0 when bytes are left (a chunk was read). */
static int run_job(io_job *j, int64_t chunk) {
    if (j->done == 0 && j->t_start == 0) j->t_start = mono_ns();
    int outcome = OUT_OK, err = 0;
    int64_t stop = chunk > 0 && j->done + chunk < j->len ? j->done + chunk : j->len;
    while (j->done < stop) {
        /* O_DIRECT while every direct read returned what it was asked; after a short one (the end of the file), the
         * rest through the buffered descriptor, as ExpertReader._fill */
        int use = (j->dfd >= 0 && !j->buffered_rest) ? j->dfd : j->fd;
        size_t want = (size_t)(stop - j->done);
        ssize_t n = pread(use, j->dst + j->done, want, (off_t)(j->off + j->done));
        if (n < 0) {
            if (errno == EINTR) continue;
            err = errno;
            outcome = (use == j->dfd && err == EINVAL) ? OUT_REFUSED : OUT_ERRNO;
            break;
        }
        if (n == 0) { stop = j->len; break; } /* end of the file: finished */
        j->done += n;
        if (use == j->dfd && (size_t)n < want) j->buffered_rest = 1;
    }
    if (outcome == OUT_OK && j->done < j->len && j->done >= stop && stop < j->len) return 0; /* a chunk read */
    if (outcome == OUT_OK) {
        struct stat st;
        if (fstat(j->fd, &st) != 0) {
            outcome = OUT_ERRNO;
            err = errno;
        } else if ((int64_t)st.st_dev != j->id_dev || (int64_t)st.st_ino != j->id_ino ||
                   (int64_t)st.st_size != j->id_size ||
                   (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec != j->id_mtime) {
            outcome = OUT_CHANGED;
        }
    }
    j->t_end = mono_ns();
    j->outcome = outcome;
    j->err = err;
    return 1;
}

static int pop(io_reader *r, int p) {
    int i = r->qh[p];
    if (i < 0) return -1;
    r->qh[p] = r->jobs[i].next;
    if (r->qh[p] < 0) r->qt[p] = -1;
    return i;
}

static void push(io_reader *r, int p, int i) {
    r->jobs[i].next = -1;
    if (r->qt[p] < 0) r->qh[p] = i; else r->jobs[r->qt[p]].next = i;
    r->qt[p] = i;
}

static void free_entry(io_reader *r, int i) {
    __atomic_store_n(&r->jobs[i].state, ST_FREE, __ATOMIC_RELEASE);
    r->jobs[i].gen++;
    r->jobs[i].next = r->free_head;
    r->free_head = i;
}

static void *worker(void *arg) {
    io_reader *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        int i = -1, p = 0;
        while (!r->stop) {
            if ((i = pop(r, 0)) >= 0) { p = 0; break; }
            if (r->running[0] == 0 && r->running[1] < r->low_max && (i = pop(r, 1)) >= 0) { p = 1; break; }
            pthread_cond_wait(&r->work, &r->mu);
        }
        if (i < 0) break;
        io_job *j = &r->jobs[i];
        __atomic_store_n(&j->state, ST_RUNNING, __ATOMIC_RELAXED);
        r->running[p]++;
        pthread_mutex_unlock(&r->mu);
        int finished = run_job(j, p ? r->low_chunk : 0);
        pthread_mutex_lock(&r->mu);
        r->running[p]--;
        if (!finished) {
            /* a low read between two chunks: go on unless a demand read waits (then back to the head of the low
             * queue, its progress kept), or it was released meanwhile */
            if (j->orphan) free_entry(r, i);
            else { /* to the head of its queue: the demand one when a step asked for it meanwhile (ms_io_promote) */
                int q = j->prio;
                __atomic_store_n(&j->state, ST_QUEUED, __ATOMIC_RELAXED);
                j->next = r->qh[q];
                r->qh[q] = i;
                if (r->qt[q] < 0) r->qt[q] = i;
            }
            continue;
        }
        if (j->orphan) free_entry(r, i); else __atomic_store_n(&j->state, ST_DONE, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&r->fin);
        if (p == 0 && r->running[0] == 0 && r->qh[0] < 0 && r->qh[1] >= 0) pthread_cond_broadcast(&r->work);
        else if (p == 1 && r->qh[1] >= 0) pthread_cond_signal(&r->work);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

void *ms_io_new(int n_threads, int n_jobs, int low_max, int64_t low_chunk) {
    io_reader *r = calloc(1, sizeof(io_reader));
    if (!r) return NULL;
    r->jobs = calloc((size_t)n_jobs, sizeof(io_job));
    r->th = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!r->jobs || !r->th) { free(r->jobs); free(r->th); free(r); return NULL; }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->work, NULL);
    pthread_cond_init(&r->fin, NULL);
    r->n_jobs = n_jobs;
    r->low_max = low_max < 1 ? 1 : low_max;
    r->low_chunk = low_chunk;
    r->qh[0] = r->qh[1] = r->qt[0] = r->qt[1] = -1;
    r->free_head = -1;
    for (int i = n_jobs - 1; i >= 0; i--) { r->jobs[i].next = r->free_head; r->free_head = i; }
    for (int t = 0; t < n_threads; t++) {
        if (pthread_create(&r->th[t], NULL, worker, r) != 0) break;
        r->n_threads++;
    }
    if (r->n_threads == 0) {
        free(r->jobs); free(r->th); free(r);
        return NULL;
    }
    return r;
}

/* Stop the threads once the reads they run finish (queued reads are dropped); frees the reader. */
void ms_io_free(void *h) {
    io_reader *r = h;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->work);
    pthread_mutex_unlock(&r->mu);
    for (int t = 0; t < r->n_threads; t++) pthread_join(r->th[t], NULL);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->work);
    pthread_cond_destroy(&r->fin);
    free(r->jobs);
    free(r->th);
    free(r);
}

/* Queue n reads, each 11 int64 in `spec`: fd, dfd (-1: buffered), off, dst address, len, priority (0 demand, 1 low),
 * st_dev, st_ino, st_size, st_mtime ns, unused. Writes each entry's index to ids[i]. Returns n, or -1 (nothing
 * queued) when fewer than n entries are free. */
int ms_io_submit(void *h, int n, const int64_t *spec, int64_t *ids) {
    io_reader *r = h;
    pthread_mutex_lock(&r->mu);
    int have = 0;
    for (int i = r->free_head; i >= 0 && have < n; i = r->jobs[i].next) have++;
    if (have < n) { pthread_mutex_unlock(&r->mu); return -1; }
    int low = 0;
    for (int k = 0; k < n; k++) {
        const int64_t *s = spec + 11 * k;
        int i = r->free_head;
        r->free_head = r->jobs[i].next;
        io_job *j = &r->jobs[i];
        j->fd = (int)s[0]; j->dfd = (int)s[1]; j->off = s[2]; j->dst = (char *)(intptr_t)s[3]; j->len = s[4];
        j->prio = s[5] ? 1 : 0;
        j->id_dev = s[6]; j->id_ino = s[7]; j->id_size = s[8]; j->id_mtime = s[9];
        j->done = 0; j->outcome = OUT_OK; j->err = 0; j->orphan = 0; j->buffered_rest = 0;
        j->t_start = j->t_end = 0;
        __atomic_store_n(&j->state, ST_QUEUED, __ATOMIC_RELAXED);
        push(r, j->prio, i);
        low |= j->prio;
        ids[k] = i;
    }
    /* one wake-up per read, at most one per thread (a broadcast would wake every thread for each submit) */
    for (int k = 0; k < n && k < r->n_threads; k++) pthread_cond_signal(&r->work);
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* The entry's state: 1 queued, 2 running, 3 done, 4 cancelled. A plain read: a caller polling it sees a read
 * finish at most one call late. */
int ms_io_state(void *h, int64_t i) {
    io_reader *r = h;
    return __atomic_load_n(&r->jobs[i].state, __ATOMIC_ACQUIRE);
}

/* How many of ids[0..n) are done or cancelled, counting from the first, without blocking. */
int ms_io_done_prefix(void *h, int n, const int64_t *ids) {
    io_reader *r = h;
    int k = 0;
    while (k < n) {
        int s = __atomic_load_n(&r->jobs[ids[k]].state, __ATOMIC_ACQUIRE);
        if (s != ST_DONE && s != ST_CANCELLED) break;
        k++;
    }
    return k;
}

/* Block until every one of ids[0..n) is done or cancelled. */
void ms_io_wait(void *h, int n, const int64_t *ids) {
    io_reader *r = h;
    pthread_mutex_lock(&r->mu);
    for (int k = 0; k < n; k++) {
        io_job *j = &r->jobs[ids[k]];
        while (j->state == ST_QUEUED || j->state == ST_RUNNING) pthread_cond_wait(&r->fin, &r->mu);
    }
    pthread_mutex_unlock(&r->mu);
}

/* Cancel a queued read: 1 when it was still queued (it will not run), else 0. */
int ms_io_cancel(void *h, int64_t i) {
    io_reader *r = h;
    int ok = 0;
    pthread_mutex_lock(&r->mu);
    io_job *j = &r->jobs[i];
    if (j->state == ST_QUEUED) {
        int p = j->prio, prev = -1;
        for (int q = r->qh[p]; q >= 0; prev = q, q = r->jobs[q].next) {
            if (q != (int)i) continue;
            if (prev < 0) r->qh[p] = j->next; else r->jobs[prev].next = j->next;
            if (r->qt[p] == (int)i) r->qt[p] = prev;
            break;
        }
        __atomic_store_n(&j->state, ST_CANCELLED, __ATOMIC_RELEASE);
        ok = 1;
        pthread_cond_broadcast(&r->fin);
    }
    pthread_mutex_unlock(&r->mu);
    return ok;
}

/* out[0..5) = outcome (0 ok, 1 errno, 2 O_DIRECT refused, 3 file changed), errno, bytes read, and the read's start
 * and end (CLOCK_MONOTONIC ns) of a done entry. */
void ms_io_result(void *h, int64_t i, int64_t *out) {
    io_reader *r = h;
    io_job *j = &r->jobs[i];
    out[0] = j->outcome;
    out[1] = j->err;
    out[2] = j->done;
    out[3] = j->t_start;
    out[4] = j->t_end;
}

/* Move a queued low-priority read to the demand queue (a step now needs it): 1 when it was queued low, else 0. */
int ms_io_promote(void *h, int64_t i) {
    io_reader *r = h;
    int ok = 0;
    pthread_mutex_lock(&r->mu);
    io_job *j = &r->jobs[i];
    if (j->state == ST_QUEUED && j->prio == 1) {
        int prev = -1;
        for (int q = r->qh[1]; q >= 0; prev = q, q = r->jobs[q].next) {
            if (q != (int)i) continue;
            if (prev < 0) r->qh[1] = j->next; else r->jobs[prev].next = j->next;
            if (r->qt[1] == (int)i) r->qt[1] = prev;
            break;
        }
        j->prio = 0;
        push(r, 0, (int)i);
        pthread_cond_signal(&r->work);
        ok = 1;
    } else if (j->state == ST_RUNNING && j->prio == 1) {
        j->prio = 0; /* its next chunk (if any) is queued as a demand read */
    }
    pthread_mutex_unlock(&r->mu);
    return ok;
}

/* Give the entry back: now when it is done, cancelled or queued (a queued one is cancelled first), else when its
 * read finishes. */
void ms_io_release(void *h, int64_t i) {
    io_reader *r = h;
    pthread_mutex_lock(&r->mu);
    io_job *j = &r->jobs[i];
    if (j->state == ST_QUEUED) {
        pthread_mutex_unlock(&r->mu);
        ms_io_cancel(h, i);
        pthread_mutex_lock(&r->mu);
    }
    if (j->state == ST_RUNNING) j->orphan = 1;
    else if (j->state != ST_FREE) free_entry(r, (int)i);
    pthread_mutex_unlock(&r->mu);
}

/* ------------------------------------------------------------------------------------------------------ */
/* The slot plan of one step of one layer (experts/policy.py CachePolicy.plan, the same choices):           */
/* n distinct real ids `ids`; `keep` (n_keep real ids not in ids) pinned too. Updates uses[ids] += 1 and      */
/* last[ids] = clock. Each id in a slot keeps it; the misses, in ids order, take the slots of smallest key,    */
/* ties to the lowest slot (numpy's stable argsort): empty slots first (key INT64_MIN as a double), then       */
/* resident experts by the policy's key (lfu: uses * 2^32 + last; lru: last; as doubles), then `busy` slots    */
/* (DBL_MAX; busy may be NULL), never a slot holding an id of ids or keep (inf). Writes slot_ids[n] and, for   */
/* each miss, loads[2 * j] = expert, loads[2 * j + 1] = slot; updates the slot map; returns the miss count, or  */
/* -1 when fewer slots than misses can be taken (the caller checks the sizes first).                          */
#include <float.h>
#include <math.h>

int ms_slot_plan(int policy, int n_slots, int64_t *slot_of, int64_t *expert_of, int64_t *uses, int64_t *last,
                 int64_t clock, int n, const int64_t *ids, int n_keep, const int64_t *keep, const uint8_t *busy,
                 int64_t *slot_ids, int64_t *loads) {
    int n_miss = 0;
    for (int i = 0; i < n; i++) {
        uses[ids[i]] += 1;
        last[ids[i]] = clock;
        slot_ids[i] = slot_of[ids[i]];
        if (slot_ids[i] < 0) n_miss++;
    }
    if (!n_miss) return 0;
    double keys_buf[1024];
    double *keys = n_slots <= 1024 ? keys_buf : malloc(sizeof(double) * (size_t)n_slots);
    if (!keys) return -1;
    for (int s = 0; s < n_slots; s++) {
        int64_t e = expert_of[s];
        if (e < 0) keys[s] = (double)INT64_MIN;
        else if (policy == 0) keys[s] = (double)uses[e] * 4294967296.0 + (double)last[e];
        else keys[s] = (double)last[e];
        if (busy && busy[s]) keys[s] = DBL_MAX;
    }
    for (int i = 0; i < n + n_keep; i++) {
        int64_t s = slot_of[i < n ? ids[i] : keep[i - n]];
        if (s >= 0) keys[s] = INFINITY;
    }
    int j = 0, rc = n_miss;
    for (int i = 0; i < n; i++) {
        if (slot_ids[i] >= 0) continue;
        int best = -1;
        for (int s = 0; s < n_slots; s++)
            if (keys[s] != INFINITY && (best < 0 || keys[s] < keys[best])) best = s;
        if (best < 0) { rc = -1; break; }
        keys[best] = INFINITY; /* taken: the next miss takes the next slot of the order */
        int64_t old = expert_of[best];
        if (old >= 0) slot_of[old] = -1;
        expert_of[best] = ids[i];
        slot_of[ids[i]] = best;
        slot_ids[i] = best;
        loads[2 * j] = ids[i];
        loads[2 * j + 1] = best;
        j++;
    }
    if (keys != keys_buf) free(keys);
    return rc;
}
