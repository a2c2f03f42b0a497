"""Standard-library scripts copied into images and run there."""
