"""Per-core programs: the instruction set, a builder, a printer, a validator, and the
Cyclotron-style matrix-multiplication generators (Cyclotron).

    from lowering import cannon_matmul, validate_programs, format_programs
    ps = cannon_matmul(chip, 64, 64, 64, grid=(4, 4))
    validate_programs(ps, chip)
    print(format_programs(ps))
"""

from lowering.analysis import CoreAnalysis, Count, ProgramAnalysis, analyze_programs
from lowering.builder import CoreBuilder, ProgramBuilder, affine, region
from lowering.errors import ProgramError
from lowering.isa import (
    DTYPE_BYTES,
    Affine,
    Alloc,
    Barrier,
    Channel,
    Compute,
    Cond,
    Free,
    If,
    Index,
    Instr,
    Load,
    LoadValue,
    Loop,
    Operand,
    Program,
    ProgramSet,
    Recv,
    RecvValue,
    Region,
    Send,
    SendValue,
    Set,
    Store,
    TensorDecl,
)
from lowering.kernels import KERNELS, Kernel, get_kernel, kernel_cycles, register_kernel
from lowering.matmul import (
    Grid,
    cannon_matmul,
    lower_dataflow,
    matmul_programs,
    pumma_matmul,
    resolve_grid,
    summa_matmul,
    systolic_matmul,
    weight_stationary_matmul,
)
from lowering.printer import (
    format_instr,
    format_program,
    format_programs,
    format_region,
    format_value,
)
from lowering.recurrence import (
    CANNON,
    PUMMA,
    SCHEDULES,
    SUMMA,
    SYSTOLIC,
    WEIGHT_STATIONARY,
    Access,
    Dataflow,
    MatmulRecurrence,
    MatmulSchedule,
    Rule,
    derive_dataflow,
    format_dataflow,
)
from lowering.validate import program_problems, validate_programs

__all__ = [
    # instruction set
    "DTYPE_BYTES",
    "Affine",
    "Alloc",
    "Barrier",
    "Channel",
    "Compute",
    "Cond",
    "Free",
    "If",
    "Index",
    "Instr",
    "Load",
    "LoadValue",
    "Loop",
    "Operand",
    "Program",
    "ProgramSet",
    "Recv",
    "RecvValue",
    "Region",
    "Send",
    "SendValue",
    "Set",
    "Store",
    "TensorDecl",
    # kernels
    "KERNELS",
    "Kernel",
    "get_kernel",
    "kernel_cycles",
    "register_kernel",
    # tooling
    "ProgramError",
    "ProgramBuilder",
    "CoreBuilder",
    "affine",
    "region",
    "format_programs",
    "format_program",
    "format_instr",
    "format_region",
    "format_value",
    "analyze_programs",
    "ProgramAnalysis",
    "CoreAnalysis",
    "Count",
    "validate_programs",
    "program_problems",
    # matmul dataflows (Cyclotron)
    "Access",
    "MatmulRecurrence",
    "MatmulSchedule",
    "Rule",
    "Dataflow",
    "derive_dataflow",
    "format_dataflow",
    "CANNON",
    "SUMMA",
    "WEIGHT_STATIONARY",
    "SYSTOLIC",
    "PUMMA",
    "SCHEDULES",
    "Grid",
    "resolve_grid",
    "lower_dataflow",
    "matmul_programs",
    "cannon_matmul",
    "summa_matmul",
    "weight_stationary_matmul",
    "systolic_matmul",
    "pumma_matmul",
]
