/* backends/cpu/kern.c - the matmul kernels for this variant's ISA (see kernels.h). */
#include "kernels.h"
