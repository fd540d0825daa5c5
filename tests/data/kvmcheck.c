/* Runs inside a container: open /dev/kvm, check the API version, create and drop a VM.
   Prints one line describing the node and the outcome; exits 0 only if the VM was created. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

int main(void) {
    struct stat st;
    const char *hv = getenv("HYPERLIGHT_HYPERVISOR");
    if (stat("/dev/kvm", &st) != 0) {
        printf("no /dev/kvm: %s\n", strerror(errno));
        return 2;
    }
    printf("uid=%d node=%o owner=%d:%d env=%s ", (int)getuid(), (unsigned)(st.st_mode & 07777),
           (int)st.st_uid, (int)st.st_gid, hv ? hv : "-");
    int fd = open("/dev/kvm", O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        printf("open: %s\n", strerror(errno));
        return 3;
    }
    int version = ioctl(fd, 0xAE00, 0);
    int vm = ioctl(fd, 0xAE01, 0);
    if (version != 12 || vm < 0) {
        printf("api=%d vm: %s\n", version, strerror(errno));
        return 4;
    }
    close(vm);
    close(fd);
    printf("api=12 vm=created\n");
    return 0;
}
