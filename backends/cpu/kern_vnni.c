/* backends/cpu/kern_vnni.c - the avx512 variant's kernels again, built with -mavx512vnni, used
 * when the CPU has VNNI (see kernels.h). */
#define KERN_VNNI 1
#include "kernels.h"
