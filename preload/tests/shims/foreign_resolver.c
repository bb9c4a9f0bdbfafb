/* A library fronting the CUDA driver (a tracer, another sharing layer) that a program
 * loads instead of libcuda.so.1: its cuGetProcAddress_v2 asks the driver, and answers a
 * cuMemAlloc request with its own function that forwards to the driver's. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

typedef int (*resolver_fn)(const char *, void **, int, unsigned long long, int *);
typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef void *(*dlsym_fn)(void *, const char *);

static alloc_fn driver_alloc;

static int forwarding_alloc(unsigned long long *ptr, size_t bytes) {
    return driver_alloc(ptr, bytes);
}

/* The driver's resolver, looked up with glibc's own dlsym: a preloaded exported dlsym
 * would hand back its wrapper instead. */
static resolver_fn driver_resolver(void) {
    dlsym_fn real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym)
        real_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    void *driver = dlopen("libcuda.so.1", RTLD_LAZY);
    if (!real_dlsym || !driver)
        return NULL;
    return (resolver_fn)real_dlsym(driver, "cuGetProcAddress_v2");
}

int cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                        unsigned long long flags, int *status) {
    resolver_fn resolve = driver_resolver();
    if (!resolve)
        return 500; /* CUDA_ERROR_NOT_FOUND */
    int rc = resolve(symbol, pfn, version, flags, status);
    if (rc == 0 && *pfn && strcmp(symbol, "cuMemAlloc") == 0) {
        driver_alloc = (alloc_fn)*pfn;
        *pfn = (void *)forwarding_alloc;
    }
    return rc;
}
