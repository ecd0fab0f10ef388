# loom_toolkits.m4 - detection of the optional compute toolkits. Each one, when missing,
# disables only what needs it and says so; it is an error only when the user asked for it.

# LOOM_CHECK_OPENBLAS: OpenBLAS through pkg-config (--without-openblas to skip).
AC_DEFUN([LOOM_CHECK_OPENBLAS], [
  AC_ARG_WITH([openblas],
    [AS_HELP_STRING([--with-openblas], [use OpenBLAS for large CPU matmuls (default: if found)])],
    [], [with_openblas=check])
  loom_have_openblas=no
  AS_IF([test "x$with_openblas" != xno], [
    PKG_CHECK_MODULES([OPENBLAS], [openblas], [loom_have_openblas=yes], [
      AS_IF([test "x$with_openblas" = xyes],
        [AC_MSG_ERROR([--with-openblas given but OpenBLAS was not found: apt-get install libopenblas-dev])])
    ])
  ])
  AS_IF([test $loom_have_openblas = yes],
    [loom_openblas_summary="yes ($OPENBLAS_LIBS)"
     AC_DEFINE([LOOM_HAVE_OPENBLAS], [1], [OpenBLAS is available])],
    [AS_IF([test "x$with_openblas" = xno],
       [loom_openblas_summary="no (--without-openblas)"],
       [loom_openblas_summary="no (pkg-config cannot find openblas; apt-get install libopenblas-dev)"])])
  AM_CONDITIONAL([HAVE_OPENBLAS], [test $loom_have_openblas = yes])
])

# LOOM_CHECK_CUDA: nvcc and cuBLAS under --with-cuda=DIR, else CUDA's default prefix.
AC_DEFUN([LOOM_CHECK_CUDA], [
  AC_ARG_WITH([cuda],
    [AS_HELP_STRING([--with-cuda@<:@=DIR@:>@], [build the CUDA backend with the toolkit in DIR (default: /usr/local/cuda if present)])],
    [], [with_cuda=check])
  AC_ARG_ENABLE([cuda],
    [AS_HELP_STRING([--disable-cuda], [do not build the CUDA backend])],
    [AS_IF([test "x$enableval" = xno], [with_cuda=no])])
  AC_ARG_WITH([cuda-arch],
    [AS_HELP_STRING([--with-cuda-arch=LIST], [CUDA architectures (default: 80,90 plus PTX)])],
    [CUDA_ARCHS="$withval"], [CUDA_ARCHS="80 90"])
  loom_have_cuda=no
  loom_cuda_why=""
  AS_CASE([$with_cuda],
    [no], [loom_cuda_why="disabled (--disable-cuda)"],
    [yes|check], [CUDA_HOME=/usr/local/cuda],
    [CUDA_HOME="$with_cuda"])
  AS_IF([test "x$with_cuda" != xno], [
    AC_MSG_CHECKING([for nvcc in $CUDA_HOME])
    AS_IF([test -x "$CUDA_HOME/bin/nvcc"], [
      NVCC="$CUDA_HOME/bin/nvcc"
      loom_cuda_version=`"$NVCC" --version 2>/dev/null | sed -n 's/.*release \(@<:@0-9.@:>@*\).*/\1/p'`
      AC_MSG_RESULT([yes, $loom_cuda_version])
      AC_MSG_CHECKING([for cuBLAS and the static CUDA runtime])
      loom_cuda_libdir=""
      for d in "$CUDA_HOME/lib64" "$CUDA_HOME/lib" "$CUDA_HOME/targets/x86_64-linux/lib"; do
        AS_IF([test -z "$loom_cuda_libdir" && test -e "$d/libcublas.so" && test -e "$d/libcudart_static.a"],
              [loom_cuda_libdir="$d"])
      done
      AS_IF([test -n "$loom_cuda_libdir"],
        [AC_MSG_RESULT([$loom_cuda_libdir]); loom_have_cuda=yes
         dnl the soname the module dlopens: libcublas.so.MAJOR of this toolkit
         CUBLAS_SONAME=`cd "$loom_cuda_libdir" && ls libcublas.so.@<:@0-9@:>@* 2>/dev/null | sort | head -n 1`
         AS_IF([test -z "$CUBLAS_SONAME"], [CUBLAS_SONAME=libcublas.so])],
        [AC_MSG_RESULT([no]); loom_cuda_why="nvcc found but no libcublas.so and libcudart_static.a under $CUDA_HOME"])
    ], [
      AC_MSG_RESULT([no])
      loom_cuda_why="no nvcc in $CUDA_HOME/bin (install the CUDA toolkit or pass --with-cuda=DIR)"
    ])
    AS_IF([test $loom_have_cuda = no && test "x$with_cuda" != xcheck],
      [AC_MSG_ERROR([--with-cuda given, but $loom_cuda_why])])
  ])
  AS_IF([test $loom_have_cuda = yes],
    [loom_cuda_summary="yes (nvcc $loom_cuda_version in $CUDA_HOME, archs $CUDA_ARCHS, $CUBLAS_SONAME)"],
    [loom_cuda_summary="no: $loom_cuda_why"])
  AC_SUBST([NVCC])
  AC_SUBST([CUDA_HOME])
  AC_SUBST([CUDA_ARCHS])
  AC_SUBST([CUBLAS_SONAME])
  dnl nvcc's -gencode list: SASS for every architecture asked for, PTX of the newest so that
  dnl later GPUs can JIT it; the smallest is what the probe accepts
  CUDA_GENCODE=""
  CUDA_MIN_SM=""
  loom_cuda_last=""
  for a in `echo "$CUDA_ARCHS" | tr ',' ' '`; do
    AS_CASE([$a], [*@<:@!0-9@:>@*|""], [AC_MSG_ERROR([--with-cuda-arch: '$a' is not a number like 80 or 90])])
    CUDA_GENCODE="$CUDA_GENCODE -gencode arch=compute_$a,code=sm_$a"
    AS_IF([test -z "$CUDA_MIN_SM" || test "$a" -lt "$CUDA_MIN_SM"], [CUDA_MIN_SM=$a])
    AS_IF([test -z "$loom_cuda_last" || test "$a" -gt "$loom_cuda_last"], [loom_cuda_last=$a])
  done
  AS_IF([test -n "$loom_cuda_last"],
    [CUDA_GENCODE="$CUDA_GENCODE -gencode arch=compute_$loom_cuda_last,code=compute_$loom_cuda_last"])
  AC_SUBST([CUDA_GENCODE])
  AC_SUBST([CUDA_MIN_SM])
  CUDA_LIBDIR="$loom_cuda_libdir"
  AC_SUBST([CUDA_LIBDIR])
  AM_CONDITIONAL([HAVE_CUDA], [test $loom_have_cuda = yes])
])

# LOOM_CHECK_HIP: hipcc from Debian's hipcc package (or --with-hip=DIR).
AC_DEFUN([LOOM_CHECK_HIP], [
  AC_ARG_WITH([hip],
    [AS_HELP_STRING([--with-hip@<:@=DIR@:>@], [build the HIP backend with hipcc from DIR/bin or PATH (default: if found)])],
    [], [with_hip=check])
  AC_ARG_ENABLE([hip],
    [AS_HELP_STRING([--disable-hip], [do not build the HIP backend])],
    [AS_IF([test "x$enableval" = xno], [with_hip=no])])
  AC_ARG_WITH([hip-arch],
    [AS_HELP_STRING([--with-hip-arch=LIST], [AMD GPU architectures (default: gfx90a gfx908 gfx1030)])],
    [HIP_ARCHS=`echo "$withval" | tr ',' ' '`], [HIP_ARCHS="gfx90a gfx908 gfx1030"])
  loom_have_hip=no
  loom_hip_why="disabled (--disable-hip)"
  AS_IF([test "x$with_hip" != xno], [
    loom_hip_path="$PATH"
    AS_CASE([$with_hip], [yes|check], [], [loom_hip_path="$with_hip/bin"])
    AC_PATH_PROG([HIPCC], [hipcc], [], [$loom_hip_path])
    AS_IF([test -n "$HIPCC"], [
      AC_MSG_CHECKING([for the HIP runtime library and headers])
      loom_save_LIBS=$LIBS
      loom_save_CPPFLAGS=$CPPFLAGS
      CPPFLAGS="$CPPFLAGS -D__HIP_PLATFORM_AMD__"
      LIBS="-lamdhip64 $LIBS"
      AC_LINK_IFELSE([AC_LANG_PROGRAM([[#include <hip/hip_runtime_api.h>]],
                                      [[int n; return hipGetDeviceCount(&n) == hipSuccess;]])],
        [AC_MSG_RESULT([yes]); loom_have_hip=yes],
        [AC_MSG_RESULT([no])
         loom_hip_why="hipcc found but libamdhip64 or its headers are missing (apt-get install libamdhip64-dev)"
         AS_IF([test "x$with_hip" != xcheck], [AC_MSG_ERROR([--with-hip given, but $loom_hip_why])])])
      LIBS=$loom_save_LIBS
      CPPFLAGS=$loom_save_CPPFLAGS
      HIP_OFFLOAD=""
      for a in $HIP_ARCHS; do HIP_OFFLOAD="$HIP_OFFLOAD --offload-arch=$a"; done
    ],
      [loom_hip_why="no hipcc (apt-get install hipcc, or pass --with-hip=DIR)"
       AS_IF([test "x$with_hip" != xcheck], [AC_MSG_ERROR([--with-hip given, but $loom_hip_why])])])
  ])
  AS_IF([test $loom_have_hip = yes],
    [loom_hip_summary="yes ($HIPCC, archs $HIP_ARCHS)"],
    [loom_hip_summary="no: $loom_hip_why"])
  AC_SUBST([HIP_ARCHS])
  AC_SUBST([HIP_OFFLOAD])
  AM_CONDITIONAL([HAVE_HIP], [test $loom_have_hip = yes])
])

# LOOM_CHECK_MPI: Open MPI (or another MPI with a pkg-config file) for the distributed module,
# dist/mpi/loom-mpi.so, which loom loads only in an MPI job; the core and tools never link MPI.
AC_DEFUN([LOOM_CHECK_MPI], [
  AC_ARG_WITH([mpi],
    [AS_HELP_STRING([--with-mpi], [build the MPI module for pipeline runs across processes (default: if found)])],
    [], [with_mpi=check])
  loom_have_mpi=no
  AS_IF([test "x$with_mpi" != xno], [
    PKG_CHECK_MODULES([MPI], [ompi-c], [loom_have_mpi=yes], [
      PKG_CHECK_MODULES([MPI], [mpich], [loom_have_mpi=yes], [
        AS_IF([test "x$with_mpi" = xyes],
          [AC_MSG_ERROR([--with-mpi given but no MPI was found: apt-get install libopenmpi-dev openmpi-bin])])
      ])
    ])
  ])
  AS_IF([test $loom_have_mpi = yes],
    [loom_mpi_summary="yes ($MPI_LIBS): mpirun -np N loom run|serve|bench runs a pipeline"],
    [AS_IF([test "x$with_mpi" = xno],
       [loom_mpi_summary="no (--without-mpi)"],
       [loom_mpi_summary="no (apt-get install libopenmpi-dev openmpi-bin)"])])
  AM_CONDITIONAL([HAVE_MPI], [test $loom_have_mpi = yes])
  AC_SUBST([LOOM_BUILT_MPI], [$loom_have_mpi])
])
