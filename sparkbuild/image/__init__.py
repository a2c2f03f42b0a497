"""Scripts copied into images and run there: the standard library only (vllm_wheel.py also uses
packaging, which the stage that runs it installs)."""
