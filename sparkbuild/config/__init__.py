"""What the user configures outside the matrix: the options (every environment variable is declared
here), where a project's templates and patches are found, the starter matrix."""
