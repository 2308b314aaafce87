import sys
from pathlib import Path

# the HF test layers live beside the frontend tests
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "frontend"))
