"""Loading models: Hugging Face checkpoints, GGUF files, the quantized cache, random presets."""
from typing import Callable

# progress(done, total, what): done/total in bytes of source tensor data; what names the step.
Progress = Callable[[int, int, str], None]
