/* The pod sandbox's process for the e2e cluster (no registry here to pull a pause image from):
   sleeps until a terminating signal, then exits 0. */
#include <signal.h>
#include <unistd.h>

static void done(int sig) {
    (void)sig;
    _exit(0);
}

int main(void) {
    signal(SIGTERM, done);
    signal(SIGINT, done);
    for (;;)
        pause();
}
