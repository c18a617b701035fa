/*
 * TEST DOUBLE of the CUDA driver (libcuda.so.1) for gdskv's CI. Never shipped in the package.
 *
 * kvikio dlopens "libcuda.so.1" at its first I/O and resolves a fixed list of driver symbols.
 * On a machine without a GPU there is no such library, so every kvikio read or write fails.
 * This library exports the same names; every call reports CUDA_ERROR_NOT_INITIALIZED (3), which
 * makes kvikio treat each buffer as host memory and move it through its POSIX thread pool
 * (compat mode). cuDriverGetVersion reports 12040, a version below 12080, so kvikio does not
 * require cuMemcpyBatchAsync (exported anyway, failing like the rest). cuGetErrorName and
 * cuGetErrorString return static strings.
 *
 * Built by tests/fakecuda/__init__.py at test time with
 *   gcc -shared -fPIC -Wl,-soname,libcuda.so.1
 * and loaded with ctypes.CDLL(path, RTLD_GLOBAL) only where the real libcuda.so.1 cannot be opened.
 * Every argument is ignored; the C ABI lets a function that takes no parameters stand for each.
 */

typedef int CUresult;

#define FAKE_CUDA_ERROR_NOT_INITIALIZED 3
#define FAKE_DRIVER_VERSION 12040

#define NOT_INITIALIZED(name) \
    CUresult name(void) { return FAKE_CUDA_ERROR_NOT_INITIALIZED; }

NOT_INITIALIZED(cuMemHostAlloc)
NOT_INITIALIZED(cuMemFreeHost)
NOT_INITIALIZED(cuMemHostRegister_v2)
NOT_INITIALIZED(cuMemHostUnregister)
NOT_INITIALIZED(cuMemcpyHtoDAsync_v2)
NOT_INITIALIZED(cuMemcpyDtoHAsync_v2)
NOT_INITIALIZED(cuMemcpyAsync)
NOT_INITIALIZED(cuPointerGetAttribute)
NOT_INITIALIZED(cuPointerGetAttributes)
NOT_INITIALIZED(cuCtxCreate_v2)
NOT_INITIALIZED(cuCtxDestroy_v2)
NOT_INITIALIZED(cuCtxPushCurrent_v2)
NOT_INITIALIZED(cuCtxPopCurrent_v2)
NOT_INITIALIZED(cuCtxGetCurrent)
NOT_INITIALIZED(cuCtxGetDevice)
NOT_INITIALIZED(cuMemGetAddressRange_v2)
NOT_INITIALIZED(cuDeviceGet)
NOT_INITIALIZED(cuDeviceGetCount)
NOT_INITIALIZED(cuDeviceGetAttribute)
NOT_INITIALIZED(cuDevicePrimaryCtxRetain)
NOT_INITIALIZED(cuDevicePrimaryCtxRelease_v2)
NOT_INITIALIZED(cuStreamSynchronize)
NOT_INITIALIZED(cuStreamCreate)
NOT_INITIALIZED(cuStreamDestroy_v2)
NOT_INITIALIZED(cuEventSynchronize)
NOT_INITIALIZED(cuEventCreate)
NOT_INITIALIZED(cuEventDestroy_v2)
NOT_INITIALIZED(cuEventRecord)
NOT_INITIALIZED(cuEventQuery)
NOT_INITIALIZED(cuLaunchHostFunc)
NOT_INITIALIZED(cuMemcpyBatchAsync)

CUresult cuDriverGetVersion(int *version)
{
    if (version == 0) {
        return 1; /* CUDA_ERROR_INVALID_VALUE */
    }
    *version = FAKE_DRIVER_VERSION;
    return 0;
}

CUresult cuGetErrorName(CUresult error, const char **name)
{
    if (name == 0) {
        return 1;
    }
    *name = error == FAKE_CUDA_ERROR_NOT_INITIALIZED ? "CUDA_ERROR_NOT_INITIALIZED"
                                                     : "CUDA_ERROR_UNKNOWN (gdskv test double)";
    return 0;
}

CUresult cuGetErrorString(CUresult error, const char **text)
{
    if (text == 0) {
        return 1;
    }
    *text = error == FAKE_CUDA_ERROR_NOT_INITIALIZED
                ? "initialization error (gdskv test double of libcuda: no GPU here)"
                : "unknown error (gdskv test double of libcuda)";
    return 0;
}
