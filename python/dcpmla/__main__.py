"""python -m dcpmla: what this build of the package holds (version, CUDA backend, architectures)."""

import dcpmla


def main():
    print(f"dcpmla {dcpmla.__version__}")
    if dcpmla.cuda_available:
        usable = "a usable GPU" if dcpmla.cuda_device_available() else "no usable GPU on this machine"
        print(f"CUDA backend: built ({dcpmla.cuda_architectures}); {usable}")
    else:
        print("CUDA backend: not built (CPU only; pip install with nvcc on PATH or DCPMLA_CUDA=1)")


main()
