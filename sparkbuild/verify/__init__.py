"""Serve the image, check each check's answers and kernel path, benchmark it, judge the speed against
the baseline."""
