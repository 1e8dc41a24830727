// The reference forward of tests/test_llama_cpp_logits.py: llama.cpp's own evaluation of a GGUF.
//
//   llama_logits MODEL.gguf OUT.npy TOKEN [TOKEN ...]
//
// Loads MODEL (the first shard of a split file names the rest), evaluates the tokens as one batch
// at positions 0..n-1 with a logit row for every position, and writes them to OUT.npy as a
// little-endian float32 array [n_tokens, n_vocab]. The K/V cache is kept in f32, so what differs
// from our numpy forward is the weights' arithmetic, not the cache's storage. Exit 1 with the
// reason on stderr (llama.cpp's own log lines before it) when the file does not load or decode.
#include "llama.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static int fail(const char * what) {
    std::fprintf(stderr, "error: %s\n", what);
    return 1;
}

// A version 1.0 .npy header: magic, version, header length, then a Python dict padded with spaces
// to a 64-byte boundary and ended by a newline (the format numpy.load reads).
static bool write_npy(const char * path, const float * data, int64_t rows, int64_t cols) {
    std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (" +
                       std::to_string(rows) + ", " + std::to_string(cols) + "), }";
    size_t total = 10 + dict.size() + 1;
    dict.append((64 - total % 64) % 64, ' ');
    dict.push_back('\n');
    FILE * f = std::fopen(path, "wb");
    if (!f) {
        return false;
    }
    const uint16_t len = (uint16_t) dict.size();
    const unsigned char head[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    bool ok = std::fwrite(head, 1, 8, f) == 8 && std::fwrite(&len, 2, 1, f) == 1 &&
              std::fwrite(dict.data(), 1, dict.size(), f) == dict.size() &&
              std::fwrite(data, sizeof(float), rows * cols, f) == (size_t) (rows * cols);
    return std::fclose(f) == 0 && ok;
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL.gguf OUT.npy TOKEN [TOKEN ...]\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> tokens;
    for (int i = 3; i < argc; ++i) {
        char * end = nullptr;
        long v = std::strtol(argv[i], &end, 10);
        if (*end != '\0' || v < 0) {
            std::fprintf(stderr, "error: token %s is not a non-negative integer\n", argv[i]);
            return 2;
        }
        tokens.push_back((llama_token) v);
    }
    const int32_t n = (int32_t) tokens.size();

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = false;      // the plain CPU dot products, no weight repacking: where the
                                     // CPU lists AMX the repacked matmul can die (docs/DEVELOPING.md)
    mp.check_tensors = true;         // a block with a NaN/inf scale is refused at load
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        return fail("the model did not load (llama.cpp's log above says why)");
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (llama_token t : tokens) {
        if (t >= n_vocab) {
            std::fprintf(stderr, "error: token %d is outside the vocabulary of %d\n", t, n_vocab);
            return 2;
        }
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) n;
    cp.n_batch = (uint32_t) n;
    cp.n_ubatch = (uint32_t) n;      // one graph for the whole sequence
    cp.n_seq_max = 1;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.n_threads = 1;                // the files are tiny; one thread leaves the other cores be
    cp.n_threads_batch = 1;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        return fail("no context for this model (llama.cpp's log above says why)");
    }

    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int32_t i = 0; i < n; ++i) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;          // a logit row for every position
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) {
        return fail("llama_decode failed");
    }

    std::vector<float> out((size_t) n * n_vocab);
    for (int32_t i = 0; i < n; ++i) {
        const float * row = llama_get_logits_ith(ctx, i);
        if (!row) {
            return fail("no logits for a position");
        }
        std::copy(row, row + n_vocab, out.begin() + (size_t) i * n_vocab);
    }
    if (!write_npy(argv[2], out.data(), n, n_vocab)) {
        return fail("could not write the output file");
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
