"""Test-wide settings. OpenMP must wait passively: the suite shares 2 cores with subprocesses (redis, engines),
and spinning OpenMP threads made model steps 30-60x slower under such load (see kvfabric.cli)."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
