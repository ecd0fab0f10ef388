/* tests/plugins/gone.c - a library a test module links against and that is then nowhere on the
 * loader's path, as libcublas is on a machine without CUDA. */
int loom_test_gone_function(void);
int loom_test_gone_function(void)
{
    return 1;
}
