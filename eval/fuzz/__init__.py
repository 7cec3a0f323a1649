"""Fuzzing halo's parsers: targets.py says what is fuzzed and which errors each parser may raise, run.py
runs the targets (atheris, else hypothesis), corpus/ holds the seeds and every crash found so far."""
