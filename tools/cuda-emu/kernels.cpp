// cuda-emu: every kernel of kernels/*.cu, compiled for the host (cuda_emu.h), and the table
// cuModuleGetFunction looks entries up in. build.sh checks that the table names every
// `__global__` entry of kernels/ and nothing else.
#include "cuda_emu.h"

// One namespace per source: sources may share __device__ helper names (lerp_elem).
namespace group_ops {
#include "../../kernels/group_ops.cu"
}
namespace adamw {
#include "../../kernels/adamw.cu"
}
namespace adam8bit {
#include "../../kernels/adam8bit.cu"
}
namespace muon {
#include "../../kernels/muon.cu"
}
namespace newton_schulz {
#include "../../kernels/newton_schulz.cu"
}
namespace reduce_ranks {
#include "../../kernels/reduce_ranks.cu"
}
namespace shampoo {
#include "../../kernels/shampoo.cu"
}

#define ENTRY(ns, name, barriers)                                   \
    {                                                               \
        #name, &cuda_emu::Invoker<decltype(&ns::name), &ns::name>::run, \
            &cuda_emu::Invoker<decltype(&ns::name), &ns::name>::bad_pointer, barriers \
    }

namespace cuda_emu {

static const KernelEntry KERNELS[] = {
    ENTRY(group_ops, group_zero, false),
    ENTRY(group_ops, group_scale, false),
    ENTRY(group_ops, group_add, false),
    ENTRY(group_ops, group_axpy, false),
    ENTRY(group_ops, group_copy, false),
    ENTRY(group_ops, group_count_non_finite, false),
    ENTRY(group_ops, group_exact_squares, true),
    ENTRY(group_ops, group_f32_to_bf16, false),
    ENTRY(group_ops, group_bf16_to_f32, false),
    ENTRY(group_ops, group_accumulate_bf16, false),
    ENTRY(adamw, adamw_step, false),
    ENTRY(adam8bit, adam8bit_blocks, true),
    ENTRY(muon, muon_momentum, false),
    ENTRY(muon, muon_apply, false),
    ENTRY(newton_schulz, ns_transpose, true),
    ENTRY(newton_schulz, ns_sumsq_partial, true),
    ENTRY(newton_schulz, ns_normalize, true),
    ENTRY(newton_schulz, ns_symmetrize_lower, false),
    ENTRY(newton_schulz, ns_add_diagonal_f32, false),
    ENTRY(newton_schulz, ns_add_diagonal_bf16, false),
    ENTRY(reduce_ranks, reduce_ranks_f32, false),
    ENTRY(reduce_ranks, reduce_ranks_bf16, false),
    ENTRY(reduce_ranks, reduce_ranks_u8, false),
    ENTRY(shampoo, shampoo_moments, false),
    ENTRY(shampoo, shampoo_mul_abt, true),
    ENTRY(shampoo, shampoo_apply, true),
};

const KernelEntry* find_kernel(const char* name) {
    for (const KernelEntry& k : KERNELS) {
        if (strcmp(k.name, name) == 0) return &k;
    }
    return nullptr;
}

}  // namespace cuda_emu
