// The fused MSDA operator's CUDA kernel run alone, without onnxruntime, on cases written by
// benchmarks/msda_cuda_parity.py: for each case directory, every variant (value/output float32 or float16,
// locations/weights float32 or float16) through both the wide (8 channels a thread) and the scalar path, outputs
// written beside the inputs for the CPU kernel to be compared with, bit for bit, on the machine that wrote them.
//
// It includes the kernel's own translation unit, so what runs is the library's code (same templates, same flags:
// -fmad=false), not a copy; msda_op.cc is linked for the symbols that unit references.
#include "../d2export/kernels/native/msda_op_cuda.cu"

#include <cstdio>
#include <fstream>
#include <vector>

namespace {

std::vector<char> slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void* to_device(const std::vector<char>& host) {
  void* p = nullptr;
  check(cudaMalloc(&p, host.size() ? host.size() : 1), "cudaMalloc");
  check(cudaMemcpy(p, host.data(), host.size(), cudaMemcpyHostToDevice), "copy in");
  return p;
}

template <typename T, typename U, int V>
void run(const std::string& dir, const std::string& value_name, const std::string& sampling_name,
         msda::Tensors t, const Levels& levels, size_t out_bytes) {
  const std::vector<char> value = slurp(dir + "/value_" + value_name + ".bin");
  const std::vector<char> loc = slurp(dir + "/loc_" + sampling_name + ".bin");
  const std::vector<char> attn = slurp(dir + "/attn_" + sampling_name + ".bin");
  t.value = to_device(value);
  t.loc = to_device(loc);
  t.attn = to_device(attn);
  void* out = nullptr;
  check(cudaMalloc(&out, out_bytes), "cudaMalloc out");
  check(cudaMemset(out, 0xff, out_bytes), "memset");  // NaN everywhere: a value never written shows
  t.out = out;
  launch<T, U, V>(t, levels, nullptr);
  check(cudaGetLastError(), "launch");
  check(cudaDeviceSynchronize(), "kernel");
  std::vector<char> host(out_bytes);
  check(cudaMemcpy(host.data(), out, out_bytes, cudaMemcpyDeviceToHost), "copy out");
  const std::string name = dir + "/cuda_" + value_name + "_" + sampling_name + "_v" + std::to_string(V) + ".bin";
  std::ofstream(name, std::ios::binary).write(host.data(), static_cast<std::streamsize>(host.size()));
  for (const void* p : {t.value, t.loc, t.attn, static_cast<const void*>(out)}) cudaFree(const_cast<void*>(p));
  std::printf("  %s\n", name.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string dir = argv[i];
      // dims.bin: int64 N, S, M, D, Lq, L, P, then shapes [L, 2], then starts [L]
      const std::vector<char> raw = slurp(dir + "/dims.bin");
      const int64_t* d = reinterpret_cast<const int64_t*>(raw.data());
      msda::Tensors t{};
      t.batch = d[0], t.tokens = d[1], t.heads = d[2], t.dim = d[3], t.queries = d[4], t.levels = d[5],
      t.points = d[6];
      Levels levels{};
      for (int64_t lv = 0; lv < t.levels; ++lv) {
        levels.height[lv] = d[7 + 2 * lv];
        levels.width[lv] = d[8 + 2 * lv];
        levels.start[lv] = d[7 + 2 * t.levels + lv];
      }
      const size_t outputs = static_cast<size_t>(t.batch * t.queries * t.heads * t.dim);
      std::printf("%s: N=%ld S=%ld M=%ld D=%ld Lq=%ld L=%ld P=%ld\n", dir.c_str(), (long)t.batch, (long)t.tokens,
                  (long)t.heads, (long)t.dim, (long)t.queries, (long)t.levels, (long)t.points);
      const bool wide = t.dim % kVector == 0;  // cudaMalloc's pointers are 256-byte aligned
      run<float, float, 1>(dir, "f32", "f32", t, levels, outputs * 4);
      run<__half, float, 1>(dir, "f16", "f32", t, levels, outputs * 2);
      run<__half, __half, 1>(dir, "f16", "f16", t, levels, outputs * 2);
      if (wide) {
        run<float, float, kVector>(dir, "f32", "f32", t, levels, outputs * 4);
        run<__half, float, kVector>(dir, "f16", "f32", t, levels, outputs * 2);
        run<__half, __half, kVector>(dir, "f16", "f16", t, levels, outputs * 2);
      }
    }
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "msda_cuda_parity: %s\n", e.what());
    return 1;
  }
  return 0;
}
