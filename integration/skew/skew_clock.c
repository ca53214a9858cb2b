/* A wall clock off by RELIQ_CLOCK_SKEW_MS milliseconds (signed), for one process, through
 * LD_PRELOAD: a host whose NTP is off, without changing the machine's clock.
 *
 * The clock-skew tests (integration/tests/clock_skew.rs) compile this with the system's C
 * compiler and run a consumer under it. Only the wall clock moves (CLOCK_REALTIME and its
 * kin, gettimeofday, time, timespec_get); the monotonic clock is left alone, as it is on a
 * skewed host.
 *
 * Why not libfaketime: librdkafka waits with C11 cnd_timedwait (glibc 2.34+), whose
 * deadline is in the wall clock it read; libfaketime does not translate that call, so a
 * skewed librdkafka either spins or sleeps through its timeouts (metadata requests time
 * out, the consumer never starts). On a really skewed host the kernel's clock is skewed
 * too and the two agree; here the deadline the process computed in its skewed clock is
 * moved back into the kernel's before the wait. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/time.h>
#include <threads.h>
#include <time.h>

#define NS_PER_S 1000000000LL

static int64_t skew_ns(void) {
    /* Read once; a race here writes the same value twice. */
    static int64_t skew = INT64_MIN;
    if (skew == INT64_MIN) {
        const char *ms = getenv("RELIQ_CLOCK_SKEW_MS");
        skew = ms ? strtoll(ms, NULL, 10) * 1000000LL : 0;
    }
    return skew;
}

static void shift(struct timespec *ts, int64_t by_ns) {
    int64_t t = (int64_t)ts->tv_sec * NS_PER_S + ts->tv_nsec + by_ns;
    ts->tv_sec = t / NS_PER_S;
    ts->tv_nsec = t % NS_PER_S;
    if (ts->tv_nsec < 0) {
        ts->tv_nsec += NS_PER_S;
        ts->tv_sec -= 1;
    }
}

static int is_wall_clock(clockid_t id) {
    return id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE || id == CLOCK_TAI;
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = dlsym(RTLD_NEXT, "clock_gettime");
    int r = real(id, ts);
    if (r == 0 && is_wall_clock(id)) shift(ts, skew_ns());
    return r;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    static int (*real)(struct timeval *restrict, void *restrict);
    if (!real) real = dlsym(RTLD_NEXT, "gettimeofday");
    int r = real(tv, tz);
    if (r == 0) {
        struct timespec ts = {tv->tv_sec, tv->tv_usec * 1000};
        shift(&ts, skew_ns());
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return r;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}

int timespec_get(struct timespec *ts, int base) {
    static int (*real)(struct timespec *, int);
    if (!real) real = dlsym(RTLD_NEXT, "timespec_get");
    int r = real(ts, base);
    if (r == TIME_UTC) shift(ts, skew_ns());
    return r;
}

/* The timed waits: each deadline was computed from the skewed wall clock; the kernel
 * waits by the real one. Every condition variable in the consumer that times out does so
 * by CLOCK_REALTIME (librdkafka's; Rust's std and tokio use futexes directly). */

int cnd_timedwait(cnd_t *restrict cond, mtx_t *restrict mutex,
                  const struct timespec *restrict deadline) {
    static int (*real)(cnd_t *restrict, mtx_t *restrict, const struct timespec *restrict);
    if (!real) real = dlvsym(RTLD_NEXT, "cnd_timedwait", "GLIBC_2.34");
    struct timespec unskewed = *deadline;
    shift(&unskewed, -skew_ns());
    return real(cond, mutex, &unskewed);
}

int pthread_cond_timedwait(pthread_cond_t *restrict cond, pthread_mutex_t *restrict mutex,
                           const struct timespec *restrict deadline) {
    static int (*real)(pthread_cond_t *restrict, pthread_mutex_t *restrict,
                       const struct timespec *restrict);
    if (!real) real = dlvsym(RTLD_NEXT, "pthread_cond_timedwait", "GLIBC_2.3.2");
    struct timespec unskewed = *deadline;
    shift(&unskewed, -skew_ns());
    return real(cond, mutex, &unskewed);
}
