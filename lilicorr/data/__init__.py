"""Prompt data: built-in evaluation suites (committed JSONL) and training prompt sources."""
from .suites import (BUILTIN_SUITES, PromptFileError, eval_prompt_texts, load_prompts, prompt_text,
                     suite_path, to_messages)

__all__ = ["BUILTIN_SUITES", "PromptFileError", "eval_prompt_texts", "load_prompts", "prompt_text",
           "suite_path", "to_messages", "iter_training_prompts"]


def __getattr__(name):   # lazy: prompt_sources parses the stdlib and imports reasoning_gym on use
    if name == "iter_training_prompts":
        from .prompt_sources import iter_training_prompts
        return iter_training_prompts
    raise AttributeError(name)
