"""The machine a benchmark ran on, printed with every benchmark's figures: speeds (bf16 above
all) depend on the CPU's model and instruction sets."""
import os
import subprocess


def cpu_description():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = flags = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
        if line.startswith("Flags:"):
            wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
            flags = " ".join(f for f in line.split(":", 1)[1].split() if f in wanted)
    return f"{model}, {os.cpu_count()} cores; relevant flags: {flags or 'none'}"
