/*
 * tools/args.c - see args.h.
 */
#include "args.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

int loom_arg_long(const char *cmd, const char *flag, const char *v, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || !*v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "%s: %s wants a whole number from %ld to %ld, not '%s'\n", cmd, flag, lo,
                hi, v ? v : "(nothing)");
        return -1;
    }
    *out = x;
    return 0;
}

int loom_arg_float(const char *cmd, const char *flag, const char *v, double lo, double hi,
                   float *out)
{
    char *end;
    double x = v ? strtod(v, &end) : 0;
    if (!v || !*v || *end || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "%s: %s wants a number from %g to %g, not '%s'\n", cmd, flag, lo, hi,
                v ? v : "(nothing)");
        return -1;
    }
    *out = (float)x;
    return 0;
}
