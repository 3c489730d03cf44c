// oneDNN 3.x's bf16 matmul primitive on Newton–Schulz's shapes (`dst ← A·B + 0.5·dst`, plain
// row-major layouts as a Newton–Schulz step has them), best of `reps` per shape, in GFLOP/s:
// to compare ragged's AMX products (`amx_products 20 matmul`) with a newer oneDNN than the
// 2.6 the `onednn` backend loads, in one period of a host whose speed moves. Run the two
// alternately. Not built by the project.
//
//   pip download --no-deps onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0 -d /tmp/d3
//   cd /tmp/d3 && for w in *.whl; do python3 -m zipfile -e $w x; done
//   I=x/onednn_devel_cpu_gomp-2023.2.0.data/data/include; L=$PWD/x/onednn_cpu_gomp-2023.2.0.data/data/lib
//   gcc -O2 -I$I scripts/onednn3_matmul.c -L$L -ldnnl -Wl,-rpath,$L -o /tmp/onednn3_matmul
//   OMP_NUM_THREADS=2 /tmp/onednn3_matmul 20
//
// (PyPI's newer `onednn` wheels, 2024–2026, are built for TBB and SYCL and need those
// runtimes too.)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "oneapi/dnnl/dnnl.h"
#define CHECK(x) do { dnnl_status_t s_ = (x); if (s_ != dnnl_success) { printf("fail %s: %d\n", #x, s_); exit(1);} } while (0)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 20;
    long shapes[][3] = {{1024,1024,1024},{2048,2048,2048},{1024,1024,3584},{3584,1024,1024},{1024,3584,1024},{256,256,1024}};
    dnnl_engine_t eng; CHECK(dnnl_engine_create(&eng, dnnl_cpu, 0));
    dnnl_stream_t st; CHECK(dnnl_stream_create(&st, eng, dnnl_stream_default_flags));
    for (int i = 0; i < 6; i++) {
        long m = shapes[i][0], k = shapes[i][1], n = shapes[i][2];
        dnnl_memory_desc_t a_md, b_md, c_md;
        dnnl_dims_t ad = {m, k}, bd = {k, n}, cd = {m, n};
        CHECK(dnnl_memory_desc_create_with_tag(&a_md, 2, ad, dnnl_bf16, dnnl_ab));
        CHECK(dnnl_memory_desc_create_with_tag(&b_md, 2, bd, dnnl_bf16, dnnl_ab));
        CHECK(dnnl_memory_desc_create_with_tag(&c_md, 2, cd, dnnl_bf16, dnnl_ab));
        dnnl_primitive_attr_t attr; CHECK(dnnl_primitive_attr_create(&attr));
        dnnl_post_ops_t po; CHECK(dnnl_post_ops_create(&po));
        CHECK(dnnl_post_ops_append_sum(po, 0.5f, 0, dnnl_data_type_undef));
        CHECK(dnnl_primitive_attr_set_post_ops(attr, po));
        dnnl_primitive_desc_t pd;
        CHECK(dnnl_matmul_primitive_desc_create(&pd, eng, a_md, b_md, NULL, c_md, attr));
        const char *impl; CHECK(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl));
        dnnl_primitive_t mm; CHECK(dnnl_primitive_create(&mm, pd));
        unsigned short *a = malloc(m*k*2), *b = malloc(k*n*2), *c = malloc(m*n*2);
        for (long j = 0; j < m*k; j++) a[j] = 0x3f80 ^ (j & 0x7f);
        for (long j = 0; j < k*n; j++) b[j] = 0x3f00 ^ (j & 0x7f);
        for (long j = 0; j < m*n; j++) c[j] = 0x3e00;
        dnnl_memory_t am, bm, cm;
        CHECK(dnnl_memory_create(&am, a_md, eng, a)); CHECK(dnnl_memory_create(&bm, b_md, eng, b)); CHECK(dnnl_memory_create(&cm, c_md, eng, c));
        dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
        double best = 1e9;
        for (int r = 0; r <= reps; r++) {
            double t = now();
            CHECK(dnnl_primitive_execute(mm, st, 3, args)); CHECK(dnnl_stream_wait(st));
            t = now() - t; if (r > 0 && t < best) best = t;
        }
        printf("onednn3 matmul %ldx%ld·%ldx%ld: %8.3f ms %6.0f GFLOP/s (%s)\n", m, k, k, n, best*1e3, 2.0*m*n*k/best/1e9, impl);
    }
    return 0;
}
