// checkpoint.cu — save and load in the HF layout, per-rank slices, atomic publication.
#include "checkpoint.h"

#include <fcntl.h>
#include <mpi.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>

#include "safetensors.h"

namespace ts {

Json hf_config(const ModelConfig& c) {
  Json j = Json::object();
  j["architectures"] = Json::array({Json("LlamaForCausalLM")});
  j["model_type"] = "llama";
  j["hidden_size"] = c.dim;
  j["intermediate_size"] = c.ffn;
  j["num_hidden_layers"] = c.layers;
  j["num_attention_heads"] = c.heads;
  j["num_key_value_heads"] = c.kv_heads;
  j["head_dim"] = c.head_dim();
  j["vocab_size"] = c.vocab;
  // RoPE has no learned positions, so generation may run past the training length; transformers
  // refuses positions beyond this, so at least 2048 (the training seq when longer).
  j["max_position_embeddings"] = std::max(c.seq, 2048);
  j["rms_norm_eps"] = shortest_decimal(c.norm_eps);
  j["rope_theta"] = shortest_decimal(c.rope_theta);
  j["tie_word_embeddings"] = false;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["torch_dtype"] = "float32";
  if (c.experts > 0) {  // HF MixtralConfig: the same fields plus the sparse MoE block's
    j["architectures"] = Json::array({Json("MixtralForCausalLM")});
    j["model_type"] = "mixtral";
    j["num_local_experts"] = c.experts;
    j["num_experts_per_tok"] = c.top_k;
    j["router_aux_loss_coef"] = double(c.aux_loss_coef);
    j["output_router_logits"] = false;
  }
  return j;
}

static std::vector<StEntry> entries_with_prefix(const ParamTable& t, const std::string& prefix) {
  std::vector<StEntry> v;
  for (const ParamEntry& e : t.entries) v.push_back({prefix + e.name, "F32", e.shape});
  return v;
}

// Writes the part of `src` (local range [b, e) of the flat buffers) that falls in each tensor, at
// its global offsets. Of a tensor replicated over a group, only the copy that counts is written.
static void write_range(SafetensorsWriter& w, const ParamTable& t, const std::string& prefix, int64_t b,
                        int64_t e, const std::vector<float>& src) {
  t.for_each_global_run(b, e, [&](const ParamEntry& p, int64_t flat, int64_t global, int64_t n) {
    if (p.counts) w.write(prefix + p.name, global, src.data() + (flat - b), n);
  });
}

static void read_range(const SafetensorsReader& r, const ParamTable& t, const std::string& prefix, int64_t b,
                       int64_t e, std::vector<float>& dst) {
  t.for_each_global_run(b, e, [&](const ParamEntry& p, int64_t flat, int64_t global, int64_t n) {
    r.read(prefix + p.name, global, dst.data() + (flat - b), n);
  });
}

static bool exists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

static void remove_tree(const std::string& p) {
  std::error_code ec;
  std::filesystem::remove_all(p, ec);
  if (ec) fatal("cannot remove %s: %s", p.c_str(), ec.message().c_str());
}

static std::string step_dir(const std::string& dir, long step) {
  char name[32];
  snprintf(name, sizeof name, "/step_%06ld", step);
  return dir + name;
}

std::vector<std::pair<long, std::string>> step_checkpoints(const std::string& dir) {
  std::vector<std::pair<long, std::string>> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    char* end = nullptr;
    if (name.rfind("step_", 0) != 0 || !e.is_directory()) continue;
    const long step = strtol(name.c_str() + 5, &end, 10);
    if (end != name.c_str() + 5 && *end == 0) found.push_back({step, e.path().string()});
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::string resolve_checkpoint(const std::string& dir) {
  if (!exists(dir)) config_error("--resume %s: no such checkpoint directory", dir.c_str());
  if (exists(dir + "/model.safetensors")) return dir;
  auto steps = step_checkpoints(dir);
  if (steps.empty())
    config_error("--resume %s: neither a checkpoint (no model.safetensors) nor a directory of step_ checkpoints",
                 dir.c_str());
  return steps.back().second;
}

// A test hook: TS_CRASH_IN_SAVE=1 kills the process after the first half of the weights is
// written, the way a node failure would, to prove the previous checkpoint survives.
static void maybe_crash_midway() {
  const char* c = getenv("TS_CRASH_IN_SAVE");
  if (c && std::string(c) == "1") {
    fprintf(stderr, "TS_CRASH_IN_SAVE: simulated crash during checkpoint save\n");
    _exit(3);
  }
}

void save_checkpoint(const std::string& save_dir, const RunConfig& rc, const ParamTable& table,
                     const std::vector<CheckpointSlice>& mine, long step, const Json& mesh) {
  const bool rank0 = world_rank() == 0;
  const std::string dir = rc.keep_last > 0 ? step_dir(save_dir, step) : save_dir;
  const std::string tmp = dir + ".tmp";
  const std::vector<StEntry> model_e = entries_with_prefix(table, "");
  std::vector<StEntry> opt_e = entries_with_prefix(table, "exp_avg.");
  for (StEntry& e : entries_with_prefix(table, "exp_avg_sq.")) opt_e.push_back(e);
  int any_opt = 0, all_opt = 0;
  for (const CheckpointSlice& s : mine) any_opt |= s.opt != nullptr;
  MPI_Allreduce(&any_opt, &all_opt, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);

  if (rank0) {
    if (rc.keep_last > 0 && !exists(save_dir) && mkdir(save_dir.c_str(), 0755) != 0)
      fatal("cannot create checkpoint directory %s: %s", save_dir.c_str(), strerror(errno));
    if (exists(tmp)) remove_tree(tmp);
    if (mkdir(tmp.c_str(), 0755) != 0) fatal("cannot create checkpoint directory %s", tmp.c_str());
    std::map<std::string, std::string> meta = {{"format", "pt"}};
    SafetensorsWriter(tmp + "/model.safetensors", model_e, meta, true).sync_and_close();
    if (all_opt) SafetensorsWriter(tmp + "/optimizer.safetensors", opt_e, meta, true).sync_and_close();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (!mine.empty()) {
    SafetensorsWriter w(tmp + "/model.safetensors", model_e, {{"format", "pt"}}, false);
    for (size_t i = 0; i < mine.size(); i++) {
      const CheckpointSlice& sl = mine[i];
      std::vector<float> v = to_host_f32(sl.weights);
      int64_t half = sl.begin + (sl.end - sl.begin) / 2;
      write_range(w, table, "", sl.begin, half, v);
      if (i == 0) maybe_crash_midway();
      std::vector<float> rest(v.begin() + (half - sl.begin), v.end());
      write_range(w, table, "", half, sl.end, rest);
    }
    w.sync_and_close();
    if (any_opt) {
      SafetensorsWriter o(tmp + "/optimizer.safetensors", opt_e, {{"format", "pt"}}, false);
      // Moments not yet allocated (a save before the first step, --steps 0) are zeros.
      auto moments = [](const Tensor& t, int64_t n) { return t.defined() ? to_host_f32(t) : std::vector<float>(size_t(n)); };
      for (const CheckpointSlice& sl : mine) {
        if (!sl.opt) continue;
        write_range(o, table, "exp_avg.", sl.begin, sl.end, moments(sl.opt->m1, sl.end - sl.begin));
        write_range(o, table, "exp_avg_sq.", sl.begin, sl.end, moments(sl.opt->m2, sl.end - sl.begin));
      }
      o.sync_and_close();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank0) {
    write_text_file_synced(tmp + "/config.json", hf_config(rc.model).dump(2) + "\n");
    Json tj = Json::object();
    tj["step"] = step;
    tj["tokens_seen"] = int64_t(step) * rc.batch * rc.model.seq;
    tj["batch"] = rc.batch;
    tj["seq"] = rc.model.seq;
    tj["seed"] = int64_t(rc.seed);
    tj["data"] = rc.data.empty() ? std::string("synthetic") : rc.data;
    tj["dtype"] = dtype_name(rc.dtype);
    tj["lr_schedule"] = rc.lr_schedule;
    tj["steps"] = rc.steps;
    tj["lr"] = rc.lr;
    tj["warmup_steps"] = rc.warmup_steps;
    tj["min_lr"] = rc.min_lr;
    tj["mesh"] = mesh;
    tj["flags"] = rc.flags;  // the whole command line: --config trainer.json repeats the run
    write_text_file_synced(tmp + "/trainer.json", tj.dump(2) + "\n");
    fsync_dir(tmp);
    // Publish with one atomic step: exchange the new directory with the old one (or rename it
    // into place), then delete the old one. Until the exchange, DIR is the previous checkpoint.
    if (exists(dir)) {
      if (renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) != 0)
        fatal("cannot publish checkpoint %s: %s", dir.c_str(), strerror(errno));
      remove_tree(tmp);
    } else if (rename(tmp.c_str(), dir.c_str()) != 0) {
      fatal("cannot publish checkpoint %s: %s", dir.c_str(), strerror(errno));
    }
    std::string parent = dir.find('/') == std::string::npos ? "." : dir.substr(0, dir.rfind('/'));
    fsync_dir(parent.empty() ? "/" : parent);
    // Only once the new checkpoint is published does the oldest one go.
    if (rc.keep_last > 0) {
      auto steps = step_checkpoints(save_dir);
      for (size_t i = 0; i + size_t(rc.keep_last) < steps.size(); i++) remove_tree(steps[i].second);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

static void check_config(const std::string& dir, const ModelConfig& c) {
  Json j;
  try {
    j = Json::parse(read_text_file(dir + "/config.json"));
    auto need = [&](const char* key, int64_t want) {
      int64_t got = j.at(key).as_int();
      if (got != want)
        config_error("checkpoint %s does not match the model: %s is %lld, the model has %lld", dir.c_str(), key,
                     (long long)got, (long long)want);
    };
    need("hidden_size", c.dim);
    need("intermediate_size", c.ffn);
    need("num_hidden_layers", c.layers);
    need("num_attention_heads", c.heads);
    need("num_key_value_heads", c.kv_heads);
    need("vocab_size", c.vocab);
    if (c.experts > 0 || j.contains("num_local_experts")) need("num_local_experts", c.experts);
  } catch (const FormatError& e) {
    config_error("checkpoint %s: config.json: %s", dir.c_str(), e.what());
  }
}

CheckpointInfo load_checkpoint(const std::string& dir, const ModelConfig& cfg, const ParamTable& table,
                               int64_t begin, int64_t end, const Tensor& weights, AdamW* opt) {
  if (!exists(dir)) config_error("--resume %s: no such checkpoint directory", dir.c_str());
  check_config(dir, cfg);
  CheckpointInfo info;
  // A plain HF model directory has no trainer.json: it loads as the weights of step 0.
  try {
    if (exists(dir + "/trainer.json")) {
      info.trainer = Json::parse(read_text_file(dir + "/trainer.json"));
      info.step = long(info.trainer.at("step").as_int());
    }
  } catch (const FormatError& e) {
    config_error("checkpoint %s: trainer.json: %s", dir.c_str(), e.what());
  }
  SafetensorsReader model(dir + "/model.safetensors");
  for (const ParamEntry& p : table.entries) {
    if (!model.has(p.name)) config_error("checkpoint %s: model.safetensors has no tensor %s", dir.c_str(), p.name.c_str());
    if (model.entry(p.name).shape != p.shape)
      config_error("checkpoint %s: tensor %s has the wrong shape", dir.c_str(), p.name.c_str());
  }
  std::vector<float> v(size_t(end - begin));
  read_range(model, table, "", begin, end, v);
  if (weights.defined()) from_host_f32(weights, v.data());
  info.has_optimizer = exists(dir + "/optimizer.safetensors");
  if (opt && info.has_optimizer) {
    SafetensorsReader o(dir + "/optimizer.safetensors");
    for (const char* pre : {"exp_avg.", "exp_avg_sq."}) {
      read_range(o, table, pre, begin, end, v);
      from_host_f32(std::string(pre) == "exp_avg." ? opt->m1 : opt->m2, v.data());
    }
  }
  return info;
}

}  // namespace ts
