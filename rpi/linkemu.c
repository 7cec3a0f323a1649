/* halo-linkemu: one emulated radio link between two network interfaces, for the test bed (rpi/links.py).
 *
 *   halo-linkemu IF_A IF_B  A2B_SPEC  B2A_SPEC  [SEED]
 *   SPEC = delay_us,jitter_us,loss,burst,rate_kbit   e.g. 5000,3000,0.05,5,100000
 *
 * Frames that arrive on IF_A leave on IF_B and the other way round (AF_PACKET, raw Ethernet frames, so every
 * protocol and address passes unchanged). Per direction: a one-way delay, uniform jitter of +- jitter_us (netem's
 * default distribution), loss from a two-state Gilbert-Elliott chain (every frame in the bad state is lost, none in
 * the good one; mean loss `loss`, mean burst `burst` frames: P(bad -> good) = 1 / burst, P(good -> bad) = loss /
 * (burst (1 - loss))) that steps once per frame and once per STEP_NS of silence (a burst is a time on the air, a
 * frame's worth of it 100 us: stepped per frame alone, as netem's gemodel does, a link carrying one small datagram
 * every 40 ms stayed in a burst for seconds, taking every retry of a round), and a rate (each frame occupies the link size x 8 / rate; 0: unlimited). One queue per
 * direction, first in first out as on one radio: a frame never leaves before the one ahead of it, so jitter delays
 * but does not reorder, and a full queue (QUEUE frames) drops at its tail. No netem is needed (this machine's
 * kernel has none). SIGUSR1 prints the counters on stderr; SIGTERM ends it after printing them.
 *
 * It runs at real-time priority where it may (root): it is the network, which on a real cluster never waits for a
 * node's CPU. At normal priority, on a machine whose cores the nodes keep busy, its wake-ups came late and a 5 ms
 * link measured 5.5 ms. The ready line says which it got. It ends with the process that started it (a bed whose
 * owner was killed left forwarders behind) and when an interface it forwards between is gone (one left behind
 * spun a core on its socket's error, at real-time priority a whole core).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_packet.h>
#include <math.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define QUEUE 4096
#define FRAME 2048
#define STEP_NS 100000LL  /* the chain's step in silence */
#define SUSPECT_NS 100000000LL  /* how often an interface that reported an error is looked up while it stays down */

#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23
#endif

typedef struct {
    double delay_ns, jitter_ns, loss, burst, rate_kbit;
    double p_good_to_bad, p_bad_to_good;
    int bad;  /* the chain's state */
    int64_t last;  /* when the chain last stepped (the previous frame), 0: never */
    int64_t free_at;  /* when the link is free again (rate, FIFO) */
    int head, count;
    int64_t due[QUEUE];
    int size[QUEUE];
    unsigned char frame[QUEUE][FRAME];
    uint64_t received, lost, overflow, sent;
    int in, out;
} Direction;

static volatile sig_atomic_t report = 0, stop = 0;
static uint64_t rng_state;

static void on_usr1(int s) { (void)s; report = 1; }
static void on_term(int s) { (void)s; stop = 1; }

static double uniform(void)  /* [0, 1): xorshift64* */
{
    rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ULL) >> 11) / 9007199254740992.0;
}

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int open_interface(const char *name)
{
    int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK, htons(ETH_P_ALL));
    if (fd < 0) {
        perror("socket(AF_PACKET)");
        exit(2);
    }
    struct sockaddr_ll at = {0};
    at.sll_family = AF_PACKET, at.sll_protocol = htons(ETH_P_ALL), at.sll_ifindex = (int)if_nametoindex(name);
    if (!at.sll_ifindex) {
        fprintf(stderr, "halo-linkemu: no interface %s\n", name);
        exit(2);
    }
    int one = 1;
    /* what this process writes out on the interface must not come back in */
    if (setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) < 0) {
        perror("PACKET_IGNORE_OUTGOING");
        exit(2);
    }
    if (bind(fd, (struct sockaddr *)&at, sizeof at) < 0) {
        perror("bind");
        exit(2);
    }
    int buffer = 4 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof buffer);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof buffer);
    return fd;
}

/* Whether an interface whose socket reported an error is gone (deleted, or another interface under its name). The
 * error is read, which clears it: an interface that is only down (ENETDOWN) comes back and the socket with it. */
static int gone(int fd, const char *name, unsigned index)
{
    int error = 0;
    socklen_t size = sizeof error;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size);
    return if_nametoindex(name) != index;
}

static void parse(Direction *d, const char *spec)
{
    if (sscanf(spec, "%lf,%lf,%lf,%lf,%lf", &d->delay_ns, &d->jitter_ns, &d->loss, &d->burst, &d->rate_kbit) != 5
        || d->delay_ns < 0 || d->jitter_ns < 0 || d->jitter_ns > d->delay_ns || d->loss < 0 || d->loss >= 1
        || d->burst < 1 || d->rate_kbit < 0) {
        fprintf(stderr, "halo-linkemu: bad spec '%s': delay_us,jitter_us (<= delay),loss (0..1),burst (>= 1),"
                        "rate_kbit (0: unlimited)\n", spec);
        exit(2);
    }
    d->delay_ns *= 1e3, d->jitter_ns *= 1e3;
    d->p_bad_to_good = 1.0 / d->burst;
    d->p_good_to_bad = d->loss > 0 ? d->loss / (d->burst * (1.0 - d->loss)) : 0.0;
    if (d->p_good_to_bad > 1.0) {  /* loss > burst / (burst + 1): no chain has that mean loss with that mean burst */
        fprintf(stderr, "halo-linkemu: bad spec '%s': a loss of %g needs bursts of at least %g frames\n", spec,
                d->loss, d->loss / (1.0 - d->loss));
        exit(2);
    }
}

/* The chain after the silence since the previous frame: its steps beyond one per frame, in closed form (a two-state
 * chain forgets its state at the rate lambda = 1 - P(good -> bad) - P(bad -> good) a step). */
static void step_silence(Direction *d, int64_t now)
{
    int64_t steps = d->last ? (now - d->last) / STEP_NS - 1 : 0;
    d->last = now;
    double moving = d->p_good_to_bad + d->p_bad_to_good;
    if (steps <= 0 || moving <= 0)
        return;
    double stationary = d->p_good_to_bad / moving, kept = pow(1.0 - moving, (double)steps);
    double p_bad = d->bad ? stationary + (1.0 - stationary) * kept : stationary * (1.0 - kept);
    d->bad = uniform() < p_bad;
}

/* A frame that arrived: lost (the chain's state after this frame), or queued with its departure time. */
static void arrive(Direction *d, const unsigned char *frame, int size, int64_t now)
{
    d->received++;
    step_silence(d, now);
    d->bad = d->bad ? uniform() >= d->p_bad_to_good : uniform() < d->p_good_to_bad;
    if (d->bad) {
        d->lost++;
        return;
    }
    if (d->count == QUEUE) {
        d->overflow++;
        return;
    }
    int64_t due = now + (int64_t)(d->delay_ns + d->jitter_ns * (2.0 * uniform() - 1.0));
    int64_t busy = d->rate_kbit > 0 ? (int64_t)(size * 8e6 / d->rate_kbit) : 0;  /* ns on the link */
    if (due < d->free_at)
        due = d->free_at;  /* first in, first out */
    d->free_at = due + busy;
    int slot = (d->head + d->count) % QUEUE;
    memcpy(d->frame[slot], frame, (size_t)size);
    d->size[slot] = size, d->due[slot] = due + busy;
    d->count++;
}

static void depart(Direction *d, int64_t now)
{
    while (d->count && d->due[d->head] <= now) {
        if (send(d->out, d->frame[d->head], (size_t)d->size[d->head], 0) >= 0)
            d->sent++;
        d->head = (d->head + 1) % QUEUE, d->count--;
    }
}

static void print_counters(const Direction *d, const char *name)
{
    fprintf(stderr, "%s received %llu lost %llu overflow %llu sent %llu queued %d\n", name,
            (unsigned long long)d->received, (unsigned long long)d->lost, (unsigned long long)d->overflow,
            (unsigned long long)d->sent, d->count);
}

int main(int argc, char **argv)
{
    prctl(PR_SET_PDEATHSIG, SIGTERM);  /* first: the starter may die at any moment from here on */
    const char *starter = getenv("HALO_LINKEMU_PARENT");  /* its pid: a parent already gone reads as the reaper */
    if (starter && strtol(starter, NULL, 10) != (long)getppid())
        return 0;
    if (argc < 5) {
        fprintf(stderr, "usage: halo-linkemu IF_A IF_B A2B_SPEC B2A_SPEC [SEED]\n");
        return 2;
    }
    static Direction dirs[2];
    parse(&dirs[0], argv[3]), parse(&dirs[1], argv[4]);
    rng_state = argc > 5 ? strtoull(argv[5], NULL, 10) * 2654435761ULL + 1 : 88172645463325252ULL;
    int a = open_interface(argv[1]), b = open_interface(argv[2]);
    const unsigned index[2] = {if_nametoindex(argv[1]), if_nametoindex(argv[2])};
    dirs[0].in = a, dirs[0].out = b, dirs[1].in = b, dirs[1].out = a;
    signal(SIGUSR1, on_usr1), signal(SIGTERM, on_term), signal(SIGINT, on_term);
    struct sched_param realtime = {.sched_priority = 10};
    int on_time = sched_setscheduler(0, SCHED_FIFO, &realtime) == 0;
    fprintf(stderr, "halo-linkemu %s <-> %s ready (%s priority)\n", argv[1], argv[2], on_time ? "real-time" : "normal");
    unsigned char frame[FRAME];
    struct pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    /* An interface whose socket reported an error and is still there (down) is looked up again every SUSPECT_NS
     * until frames come from it without an error: deleting one reports only its going down (the socket's hook is off
     * from then, its unregistering reports nothing), and a look taken before the deletion finished saw it there. */
    int64_t look_at[2] = {0, 0};  /* when to look a suspect interface up next; 0: not suspect */
    while (!stop) {
        int64_t now = now_ns(), next = -1;
        for (int i = 0; i < 2; i++) {
            if (dirs[i].count && (next < 0 || dirs[i].due[dirs[i].head] < next))
                next = dirs[i].due[dirs[i].head];
            if (look_at[i] && (next < 0 || look_at[i] < next))
                next = look_at[i];
        }
        struct timespec wait = {1, 0};
        if (next >= 0) {
            int64_t left = next > now ? next - now : 0;
            wait.tv_sec = left / 1000000000LL, wait.tv_nsec = left % 1000000000LL;
        }
        if (ppoll(fds, 2, &wait, NULL) < 0 && errno != EINTR) {
            perror("ppoll");
            return 1;
        }
        now = now_ns();
        for (int i = 0; i < 2; i++) {
            const int error = fds[i].revents & (POLLERR | POLLHUP | POLLNVAL);
            if (error || (look_at[i] && now >= look_at[i])) {
                if (gone(fds[i].fd, argv[1 + i], index[i])) {
                    fprintf(stderr, "halo-linkemu: interface %s is gone\n", argv[1 + i]);
                    stop = 1;
                }
                look_at[i] = now + SUSPECT_NS;
            }
            if (!(fds[i].revents & POLLIN))
                continue;
            if (!error)
                look_at[i] = 0;  /* frames again, no error with them: it is up */
            for (;;) {
                ssize_t n = recv(dirs[i].in, frame, sizeof frame, MSG_TRUNC);
                if (n <= 0)
                    break;
                if (n > FRAME) {  /* larger than any frame of a 1500-byte MTU with offloads off: never cut one */
                    dirs[i].overflow++;
                    continue;
                }
                arrive(&dirs[i], frame, (int)n, now);
            }
        }
        now = now_ns();
        depart(&dirs[0], now), depart(&dirs[1], now);
        if (report) {
            report = 0;
            print_counters(&dirs[0], "a2b"), print_counters(&dirs[1], "b2a");
        }
    }
    print_counters(&dirs[0], "a2b"), print_counters(&dirs[1], "b2a");
    return 0;
}
