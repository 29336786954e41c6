"""GRPO with live SGLang 0.5.16 colocated on one H200 (issue 20; README.md here)."""
