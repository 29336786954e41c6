"""nanoflash: DeepSeek-V4-Flash + GRPO in pure PyTorch."""
__version__ = "0.1.0"
