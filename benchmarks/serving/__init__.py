"""The pieces of benchmarks/e2e.py, the end-to-end benchmark (run that file;
it parses the arguments and runs the phases in order):

- workload: the texts sent and their Poisson arrivals;
- offline: phase 1, the offline baseline (measured, or given and so
  labelled);
- load: the client processes' open-loop load, unary or on berth's Stream,
  and what a step's answers come to (Step);
- stack: the stacks measured (profiles), starting and stopping one, and its
  CPU and /metrics readings;
- steps: phases 2 and 3 on one stack, the rate steps and the cache hits;
- report: the printed tables and summary, and the JSON written with --out.

benchmarks/tls.py uses the same load generator and stacks, and two pieces of
its own:

- certs: the certificates it makes in the run, and what each mode (plaintext,
  TLS, mutual TLS) serves and dials with;
- probes: connection setup (fresh channels to their first answer) and the
  closed-loop capacity.
"""
