/* backends/cpu/kern.c - the matmul kernels for this variant's ISA (see kern_template.h). */
#include "kern_template.h"
