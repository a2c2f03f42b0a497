"""Push by digest, attach the SBOM, provenance, verify result, benchmark baseline and wheels, sign,
move the readable tags; inspect, fetch wheels, retention."""
