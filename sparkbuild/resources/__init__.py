"""Data shipped with the package: defaults, kernel paths, the starter matrix, the benchmark runner;
where the packaged templates and patches are."""
