/* backends/cpu/kern_vnni.c - a variant's integer kernels again, built with -mavx512vnni (avx512)
 * or -mavxvnni (avx2), used when the CPU has that VNNI (see kern_template.h). */
#define KERN_VNNI 1
#include "kern_template.h"
