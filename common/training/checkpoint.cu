// checkpoint.cu — save and load in the HF layout, per-rank slices, atomic publication.
#include "training/checkpoint.h"
#include "training/optimizer.h"
#include "training/checkpoint_files.h"
#include "tensor/hooks.h"

#include <fcntl.h>
#include <mpi.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>
#include <cstdlib>
#include <filesystem>

#include "formats/safetensors.h"
#include "comm/comm.h"
#include "training/numerics.h"
#include "comm/watchdog.h"

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
  if (c.experts == 0) return j;
  j["num_experts_per_tok"] = c.top_k;
  j["router_aux_loss_coef"] = double(c.aux_loss_coef);
  j["output_router_logits"] = false;
  if (c.sigmoid_router || c.shared_experts > 0 || c.expert_ffn > 0) {
    j["moe_intermediate_size"] = c.expert_width();
    j["n_shared_experts"] = c.shared_experts;
  }
  if (c.sigmoid_router) {
    // transformers' Glm4MoeConfig: DeepSeek-V3's MoE block (sigmoid router, selection bias, groups,
    // shared experts, its tensor names) on the GQA attention of this model, as DeepseekV3's own
    // class is not (it needs multi-head latent attention).
    j["architectures"] = Json::array({Json("Glm4MoeForCausalLM")});
    j["model_type"] = "glm4_moe";
    j["n_routed_experts"] = c.experts;
    j["n_group"] = c.expert_groups;
    j["topk_group"] = c.group_limit;
    j["routed_scaling_factor"] = double(c.routed_scaling);
    j["norm_topk_prob"] = true;
    j["first_k_dense_replace"] = 0;      // every layer is a MoE layer
    j["num_nextn_predict_layers"] = 0;   // no multi-token prediction module
    j["use_qk_norm"] = false;
    j["partial_rotary_factor"] = 1.0;    // RoPE turns the whole head (GLM-4.5 turns half)
    Json rope = Json::object();
    rope["rope_type"] = "default";
    rope["rope_theta"] = shortest_decimal(c.rope_theta);
    rope["partial_rotary_factor"] = 1.0;
    j["rope_parameters"] = rope;
  } else {  // HF MixtralConfig (with --expert-ffn or --shared-experts a block no transformers class computes)
    j["architectures"] = Json::array({Json("MixtralForCausalLM")});
    j["model_type"] = "mixtral";
    j["num_local_experts"] = c.experts;
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

// Why the checkpoint in dir is not whole, or "": its trainer.json (read_trainer), then each file
// against its digest. Every rank checks alone, so every rank reaches the same verdict.
static std::string checkpoint_problem(const std::string& dir) {
  try {
    const TrainerState t = read_trainer(dir);
    if (!t.present) return "no trainer.json";
    for (const auto& [name, digest] : t.rec.files)
      if (file_digest(dir + "/" + name) != digest) return name + " does not match the digest trainer.json records";
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

std::string resolve_checkpoint(const std::string& dir) {
  if (!exists(dir)) config_error("--resume %s: no such checkpoint directory", dir.c_str());
  if (exists(dir + "/model.safetensors")) return dir;
  auto steps = step_checkpoints(dir);
  if (steps.empty())
    config_error("--resume %s: neither a checkpoint (no model.safetensors) nor a directory of step_ checkpoints",
                 dir.c_str());
  // Newest first; a damaged one (a disk error, a hand edit) is passed over, saying so.
  std::string passed;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string problem = checkpoint_problem(it->second);
    if (problem.empty()) {
      if (!passed.empty() && world_rank() == 0)
        printf("resume: %s; resuming from %s, the newest intact checkpoint\n", passed.c_str(), it->second.c_str());
      return it->second;
    }
    passed += (passed.empty() ? "" : "; ") + it->second + " is damaged (" + problem + ")";
  }
  config_error("--resume %s: no intact step_ checkpoint: %s", dir.c_str(), passed.c_str());
}

static std::string strip_slashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

static std::string g_locked;  // the --save directory this process holds the lock of

std::string lock_checkpoint_dir(const std::string& save_dir) {
  const std::string dir = strip_slashes(save_dir), lock = dir + ".lock";
  if (g_locked == dir) return "";
  int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return "--save " + dir + ": cannot create the lock file " + lock + ": " + strerror(errno);
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return "--save " + dir + " is in use by another job (it holds " + lock +
           "); two jobs saving to one directory would mix their checkpoints";
  }
  g_locked = dir;  // fd stays open: the lock lasts as long as the process
  return "";
}

// Temporaries of saves that never finished (a crash, a kill): with the lock held, no other job
// can be writing them.
static void remove_stale_temporaries(const std::string& save_dir, const std::string& dir, bool steps) {
  if (g_locked != strip_slashes(save_dir)) return;
  const std::string parent = dir.find('/') == std::string::npos ? "." : dir.substr(0, dir.rfind('/'));
  const std::string base = dir.substr(dir.rfind('/') + 1);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(parent.empty() ? "/" : parent, ec)) {
    const std::string name = e.path().filename().string();
    const bool mine = name.rfind(base + ".tmp", 0) == 0 ||
                      (steps && name.rfind("step_", 0) == 0 && name.find(".tmp") != std::string::npos);
    if (!mine) continue;
    remove_tree(e.path().string());
    printf("save: removed %s, the unfinished save of an earlier job\n", e.path().string().c_str());
  }
}

// The first tensor of [b, e) whose counted copy holds a NaN or an infinity, or "".
static std::string first_nonfinite(const ParamTable& t, const std::string& prefix, int64_t b, int64_t e,
                                   const std::vector<float>& src) {
  std::string found;
  t.for_each_global_run(b, e, [&](const ParamEntry& p, int64_t flat, int64_t, int64_t n) {
    if (!found.empty() || !p.counts) return;
    for (int64_t k = 0; k < n && found.empty(); k++)
      if (!std::isfinite(src[size_t(flat - b + k)])) found = prefix + p.name;
  });
  return found;
}

// trainer.json: where the run stands, its schedule, its mesh and every flag, each file's digest
// and a seal over all of it.
static Json trainer_json(const RunConfig& rc, long step, const Json& mesh, const std::string& tmp, const std::string& at) {
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
  // The batches an --on-spike rewind skipped: a resume from here goes on skipping them.
  if (!numerics().skips().empty()) tj["skipped_batches"] = numerics().skips_json();
  // The whole command line: --config trainer.json repeats the run. How the run saves and records
  // is not part of what it computes: an asynchronous save writes the same bytes as a synchronous
  // one, and a resume chooses for itself.
  Json flags = Json::object();
  if (rc.flags.is_object())
    for (auto& [k, v] : rc.flags.items())
      if (k != "async-save" && k != "flight-recorder" && k != "flight-dir") flags[k] = v;
  tj["flags"] = flags;
  // Each file's digest makes the checkpoint verifiable as one whole on load.
  Json files = Json::object();
  try {
    for (const char* f : {"model.safetensors", "optimizer.safetensors", "config.json"})
      if (exists(tmp + "/" + f)) files[f] = file_digest(tmp + "/" + f);
  } catch (const FormatError& e) {
    fatal("cannot read back %s: %s", at.c_str(), e.what());
  }
  tj["files"] = files;
  tj["seal"] = trainer_seal(tj);  // last: it covers every member above
  return tj;
}

// Publishes tmp as dir, then drops the checkpoints past --keep-last.
static void publish(const std::string& tmp, const std::string& dir, const std::string& save_dir, const RunConfig& rc) {
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

// ----- saving: staged, written, agreed on, sealed and published --------------------------------
// A save runs in five parts. (1) Every rank agrees on the layout and rank 0 creates the temporary
// directory and the files' headers. (2) Each rank copies its slices out of the training state
// (the staging buffer: fp32 weights and both moments, 12 bytes per parameter it writes). (3) Each
// rank writes its part and syncs it. (4) Every rank agrees that every part is written and finite.
// (5) Rank 0 writes config.json and trainer.json with each file's digest and the seal, and
// publishes the directory with one rename. A synchronous save does all five before training goes
// on; --async-save does (1) and (2), writes (3) on a background thread, agrees (4) at the first
// step boundary where every rank has finished (one small all-reduce per step while a save is in
// flight), and seals and publishes (5) on rank 0's background thread. The bytes are the same.

struct StagedSlice {
  int64_t begin = 0, end = 0;
  std::vector<float> weights, m1, m2;  // m1/m2 empty when the slice carries no optimizer state
};

struct Save {
  std::string save_dir, dir, tmp, at;
  RunConfig rc;
  const ParamTable* table = nullptr;  // the model's: it outlives the run's last save
  long step = 0;
  Json mesh;
  std::vector<StEntry> model_e, opt_e;
  bool any_opt = false, all_opt = false;
  std::vector<StagedSlice> staged;
  std::string bad;  // the writer's verdict: the first tensor with a non-finite value, or ""
  std::atomic<bool> written{false}, agreed{false};
  std::thread writer, sealer;
};
static std::unique_ptr<Save> g_save;  // the save in flight (--async-save), or null
static size_t g_staging_peak = 0;
size_t checkpoint_staging_peak() { return g_staging_peak; }

// While a save's files are unpublished, a fatal error on this rank (a full disk, a failed sync)
// removes them and the --save lock before the job ends, and says so in the error's line.
static std::string g_unpublished;
static std::string cleanup_failed_save() {
  if (g_unpublished.empty()) return "";
  std::error_code ec;
  std::filesystem::remove_all(g_unpublished, ec);
  std::string said = "; removed the unfinished save " + g_unpublished;
  if (!g_locked.empty() && unlink((g_locked + ".lock").c_str()) == 0) said += " and the lock " + g_locked + ".lock";
  g_unpublished.clear();
  return said + "; the last published checkpoint is intact";
}

// Part (1): the layout agreed, the temporary directory and the empty files created.
static std::unique_ptr<Save> begin_save(const std::string& save_dir, const RunConfig& rc, const ParamTable& table,
                                        const std::vector<CheckpointSlice>& mine, long step, const Json& mesh) {
  auto s = std::make_unique<Save>();
  const bool rank0 = world_rank() == 0;
  s->save_dir = save_dir, s->rc = rc, s->table = &table, s->step = step, s->mesh = mesh;
  s->dir = rc.keep_last > 0 ? step_dir(save_dir, step) : strip_slashes(save_dir);
  s->at = "checkpoint of step " + std::to_string(step);
  s->model_e = entries_with_prefix(table, "");
  s->opt_e = entries_with_prefix(table, "exp_avg.");
  for (StEntry& e : entries_with_prefix(table, "exp_avg_sq.")) s->opt_e.push_back(e);
  // {any optimizer state, rank 0's pid}: the temporary directory is named after this job, so two
  // jobs never write into one.
  int mine_flags[2] = {0, rank0 ? int(getpid()) : 0}, all_flags[2] = {0, 0};
  for (const CheckpointSlice& sl : mine) mine_flags[0] |= sl.opt != nullptr;
  watched_allreduce(mine_flags, all_flags, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD, "all_reduce (" + s->at + ": its layout)");
  s->any_opt = mine_flags[0], s->all_opt = all_flags[0];
  s->tmp = s->dir + ".tmp." + std::to_string(all_flags[1]);
  g_unpublished = s->tmp;
  set_fatal_cleanup(cleanup_failed_save);
  if (rank0) {
    if (rc.keep_last > 0 && !exists(save_dir) && mkdir(save_dir.c_str(), 0755) != 0)
      fatal("cannot create checkpoint directory %s: %s", save_dir.c_str(), strerror(errno));
    remove_stale_temporaries(save_dir, s->dir, rc.keep_last > 0);
    if (exists(s->tmp)) remove_tree(s->tmp);
    if (mkdir(s->tmp.c_str(), 0755) != 0) fatal("cannot create checkpoint directory %s: %s", s->tmp.c_str(), strerror(errno));
    std::map<std::string, std::string> meta = {{"format", "pt"}};
    SafetensorsWriter(s->tmp + "/model.safetensors", s->model_e, meta, true).sync_and_close();
    if (s->all_opt) SafetensorsWriter(s->tmp + "/optimizer.safetensors", s->opt_e, meta, true).sync_and_close();
  }
  watched_barrier(MPI_COMM_WORLD, "barrier (" + s->at + ": files created)");
  return s;
}

// The staging buffers of the last save, reused by the next: pages already touched are neither
// zeroed nor faulted in again (the first save pays that, about 1 s per GB).
static std::vector<StagedSlice> g_staging_pool;

// t's values as fp32 into `out`: a CPU fp32 tensor by a parallel copy into the reused buffer.
static void stage_into(std::vector<float>& out, const Tensor& t) {
  if (t.device() != Device::CPU || t.dtype != DType::F32) {
    out = to_host_f32(t);
    return;
  }
  const int64_t n = t.numel(), chunk = int64_t(1) << 20;
  out.resize(size_t(n));
  const float* src = t.f32();
  float* dst = out.data();
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < n; c += chunk) memcpy(dst + c, src + c, size_t(std::min(chunk, n - c)) * 4);
}

// Part (2): this rank's slices copied out of the training state. Moments not yet allocated (a
// save before the first step, --steps 0) are zeros.
static void stage(Save& s, const std::vector<CheckpointSlice>& mine) {
  size_t bytes = 0;
  s.staged = std::move(g_staging_pool);
  s.staged.resize(mine.size());
  for (size_t i = 0; i < mine.size(); i++) {
    const CheckpointSlice& sl = mine[i];
    StagedSlice& st = s.staged[i];
    st.begin = sl.begin, st.end = sl.end;
    stage_into(st.weights, sl.weights);
    auto moments = [&](std::vector<float>& out, const Tensor& t) {
      if (t.defined()) stage_into(out, t);
      else out.assign(size_t(sl.end - sl.begin), 0.f);
    };
    if (sl.opt) moments(st.m1, sl.opt->m1), moments(st.m2, sl.opt->m2);
    else st.m1.clear(), st.m2.clear();
    bytes += 4 * (st.weights.size() + st.m1.size() + st.m2.size());
  }
  g_staging_peak = std::max(g_staging_peak, bytes);
}

// Part (3): the staged slices into the files rank 0 created; the first tensor holding a
// non-finite value, or "".
static std::string write_staged(const Save& s) {
  std::string bad;
  if (s.staged.empty()) return bad;
  const ParamTable& table = *s.table;
  SafetensorsWriter w(s.tmp + "/model.safetensors", s.model_e, {{"format", "pt"}}, false);
  for (const StagedSlice& sl : s.staged) {
    if (bad.empty()) bad = first_nonfinite(table, "", sl.begin, sl.end, sl.weights);
    write_range(w, table, "", sl.begin, sl.end, sl.weights);
  }
  w.sync_and_close();
  if (!s.any_opt) return bad;
  SafetensorsWriter o(s.tmp + "/optimizer.safetensors", s.opt_e, {{"format", "pt"}}, false);
  for (const StagedSlice& sl : s.staged) {
    if (sl.m1.empty()) continue;
    for (const char* pre : {"exp_avg.", "exp_avg_sq."}) {
      const std::vector<float>& m = std::string(pre) == "exp_avg." ? sl.m1 : sl.m2;
      if (bad.empty()) bad = first_nonfinite(table, pre, sl.begin, sl.end, m);
      write_range(o, table, pre, sl.begin, sl.end, m);
    }
  }
  o.sync_and_close();
  return bad;
}

// Part (4), collective: every rank has written its slices once this agreement returns.
// Non-finite weights or moments (a diverged step) are never published: the last good checkpoint
// stays where it is.
static void agree_written(Save& s) {
  const std::string err = first_error(s.bad.empty() ? "" : s.bad + " holds non-finite values", MPI_COMM_WORLD, s.at);
  if (!err.empty()) {
    if (world_rank() == 0) remove_tree(s.tmp);
    g_unpublished.clear();
    config_error("%s not published: %s (the run diverged; try a lower --lr). The last good checkpoint in %s is kept.",
                 s.at.c_str(), err.c_str(), s.save_dir.c_str());
  }
  s.agreed = true;
}

// Part (5), rank 0: the seal, then the one rename that publishes.
static void seal_and_publish(const Save& s) {
  write_text_file_synced(s.tmp + "/config.json", hf_config(s.rc.model).dump(2) + "\n");
  const Json tj = trainer_json(s.rc, s.step, s.mesh, s.tmp, s.at);
  write_text_file_synced(s.tmp + "/trainer.json", tj.dump(2) + "\n");
  fsync_dir(s.tmp);
  publish(s.tmp, s.dir, s.save_dir, s.rc);
}

// Collective: the save in flight, agreed, sealed and published; the seconds this rank waited.
double finish_async_save() {
  if (!g_save) return 0;
  auto t0 = std::chrono::steady_clock::now();
  Save& s = *g_save;
  if (s.writer.joinable()) s.writer.join();
  if (!s.agreed) agree_written(s);
  if (world_rank() == 0 && !s.sealer.joinable()) seal_and_publish(s);
  if (s.sealer.joinable()) s.sealer.join();
  watched_barrier(MPI_COMM_WORLD, "barrier (" + s.at + ": published)");
  g_unpublished.clear();
  g_staging_pool = std::move(s.staged);
  g_save.reset();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void progress_async_save() {
  if (!g_save || g_save->agreed) return;
  Save& s = *g_save;
  int mine = s.written ? 1 : 0, all = 0;
  watched_allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, "all_reduce (" + s.at + ": every part written?)");
  if (!all) return;
  s.writer.join();
  agree_written(s);
  if (world_rank() == 0) s.sealer = std::thread([&s] { seal_and_publish(s); });
}

void save_checkpoint(const std::string& save_dir, const RunConfig& rc, const ParamTable& table,
                     const std::vector<CheckpointSlice>& mine, long step, const Json& mesh) {
  if (g_save) {  // at most one save in flight: this one waits for the last
    const std::string last = g_save->at;
    const double waited = finish_async_save();
    if (world_rank() == 0 && waited >= 0.001)  // it was still being written or sealed
      printf("save: waited %.3f s for the %s to be published before the checkpoint of step %ld\n", waited,
             last.c_str(), step);
  }
  std::unique_ptr<Save> s = begin_save(save_dir, rc, table, mine, step, mesh);
  stage(*s, mine);
  if (rc.async_save) {
    Save* p = s.get();
    s->writer = std::thread([p] {
      p->bad = write_staged(*p);
      p->written = true;
    });
    g_save = std::move(s);
    return;
  }
  s->bad = write_staged(*s);
  g_save = std::move(s);
  finish_async_save();  // (4) and (5) at once
}

// Dense and mixture-of-experts checkpoints differ in kind, not in one number: say which is which
// and the flags that match, rather than a missing key.
static void check_moe_config(const Json& j, const ModelConfig& c) {
  auto get = [&](const char* key, int64_t def) { return j.contains(key) ? j.at(key).as_int() : def; };
  const int64_t experts = get("n_routed_experts", get("num_local_experts", 0)), top_k = get("num_experts_per_tok", 0);
  if (experts == 0 && c.experts > 0)
    throw FormatError("this checkpoint is dense; it has no experts (resume it without --experts)");
  if (experts > 0 && c.experts == 0)
    throw FormatError("this checkpoint is a mixture of experts; resume it with --experts " + std::to_string(experts) +
                      " --top-k " + std::to_string(top_k));
  if (experts != c.experts)
    throw FormatError("this checkpoint has " + std::to_string(experts) + " experts per layer, the model " +
                      std::to_string(c.experts) + " (--experts " + std::to_string(experts) + ")");
  // DeepSeekMoE's tensors: the shared experts and the routing bias are there or not.
  const int64_t shared = get("n_shared_experts", 0);
  const bool sigmoid = j.contains("model_type") && j.at("model_type").as_string() == "glm4_moe";
  if (shared != c.shared_experts)
    throw FormatError("this checkpoint has " + std::to_string(shared) + " shared experts, the model " +
                      std::to_string(c.shared_experts) + " (--shared-experts " + std::to_string(shared) + ")");
  if (sigmoid != c.sigmoid_router)
    throw FormatError(std::string("this checkpoint was trained with the ") + (sigmoid ? "sigmoid" : "softmax") +
                      " router (--router " + (sigmoid ? "sigmoid" : "softmax") + ")");
  if (!sigmoid) return;
  // Which experts a token may reach: --expert-groups and --group-limit.
  if (get("n_group", 1) != c.expert_groups || get("topk_group", 1) != c.group_limit)
    throw FormatError("this checkpoint routes within the best " + std::to_string(get("topk_group", 1)) + " of " +
                      std::to_string(get("n_group", 1)) + " expert groups (--expert-groups " +
                      std::to_string(get("n_group", 1)) + " --group-limit " + std::to_string(get("topk_group", 1)) + ")");
}

void check_hf_config(const Json& j, const ModelConfig& c) {
  auto differs = [](const char* key, const std::string& got, const std::string& want) {
    return FormatError(std::string("does not match the model: ") + key + " is " + got + ", the model has " + want);
  };
  auto need = [&](const char* key, int64_t want) {
    int64_t got = j.at(key).as_int();
    if (got != want) throw differs(key, std::to_string(got), std::to_string(want));
  };
  need("hidden_size", c.dim);
  need("intermediate_size", c.ffn);
  need("num_hidden_layers", c.layers);
  need("num_attention_heads", c.heads);
  need("num_key_value_heads", c.kv_heads);
  need("vocab_size", c.vocab);
  check_moe_config(j, c);
  // The fields below change what the model computes; absent, they take transformers' defaults.
  if (j.contains("head_dim")) need("head_dim", c.head_dim());
  auto real = [&](const char* key, double def, float want) {
    const double got = j.contains(key) ? j.at(key).as_double() : def;
    if (float(got) != want) throw differs(key, Json(got).dump(), Json(double(want)).dump());
  };
  real("rms_norm_eps", 1e-6, c.norm_eps);
  real("rope_theta", 10000.0, c.rope_theta);
  if (j.contains("tie_word_embeddings") && j.at("tie_word_embeddings").as_bool())
    throw differs("tie_word_embeddings", "true", "false (a separate lm_head)");
  if (j.contains("hidden_act") && j.at("hidden_act").as_string() != "silu")
    throw differs("hidden_act", "'" + j.at("hidden_act").as_string() + "'", "'silu' (SwiGLU)");
  // RoPE has no table to outgrow, but positions past the declared maximum were never trained.
  if (j.contains("max_position_embeddings")) {
    const int64_t max_pos = j.at("max_position_embeddings").as_int();
    if (max_pos < c.seq)
      throw FormatError("max_position_embeddings is " + std::to_string(max_pos) + ", shorter than --seq " +
                        std::to_string(c.seq));
  }
}

static void check_config(const std::string& dir, const ModelConfig& c) {
  try {
    check_hf_config(Json::parse(read_text_file(dir + "/config.json")), c);
  } catch (const FormatError& e) {
    config_error("checkpoint %s: config.json: %s", dir.c_str(), e.what());
  }
}

TrainerRecord parse_trainer_record(const Json& t) {
  TrainerRecord r;
  r.step = long(t.at("step").as_int());
  auto positive = [&](const char* key) {
    if (!t.contains(key)) return 0;
    const int64_t v = t.at(key).as_int();
    if (v < 1 || v > INT32_MAX) throw FormatError(std::string(key) + " is " + std::to_string(v) + ", not a positive int");
    return int(v);
  };
  r.batch = positive("batch");
  r.seq = positive("seq");
  // The data order reads window (step·batch + i)·seq: a step whose token count overflows 64 bits
  // (or a negative one) would read outside the data.
  const int64_t per_step = int64_t(std::max(r.batch, 1)) * std::max(r.seq, 1);
  if (r.step < 0 || r.step > INT64_MAX / per_step)
    throw FormatError("step " + std::to_string(r.step) + " is outside [0, " + std::to_string(INT64_MAX / per_step) + "]");
  if (t.contains("dtype")) r.dtype = t.at("dtype").as_string();
  if (t.contains("data")) r.data = t.at("data").as_string();
  if (t.contains("seed")) r.seed = t.at("seed").as_int(), r.has_seed = true;
  if (t.contains("files"))
    for (auto& [name, digest] : t.at("files").items()) {
      if (name.empty() || name.find('/') != std::string::npos || name == "trainer.json" || name[0] == '.')
        throw FormatError("files: '" + name + "' is not a file of a checkpoint");
      r.files.push_back({name, digest.as_string()});
    }
  return r;
}

std::string trainer_seal(const Json& trainer) {
  Json body = Json::object();
  for (auto& [k, v] : trainer.items())
    if (k != "seal") body[k] = v;
  return bytes_digest(body.dump(2));
}

TrainerState read_trainer(const std::string& dir) {
  TrainerState t;
  if (!exists(dir + "/trainer.json")) {
    if (exists(dir + "/optimizer.safetensors"))
      throw FormatError("optimizer.safetensors without trainer.json: a partial checkpoint (its step is unknown)");
    return t;  // a plain HF model directory
  }
  t.present = true;
  try {
    t.json = Json::parse(read_file_or_throw(dir + "/trainer.json"));
    t.rec = parse_trainer_record(t.json);
    if (!t.json.contains("seal")) throw FormatError("no seal (every save writes one: the file was rewritten since)");
    if (t.json.at("seal").as_string() != trainer_seal(t.json))
      throw FormatError("does not match its seal (changed since the save)");
  } catch (const FormatError& e) {
    throw FormatError(std::string("trainer.json: ") + e.what());
  }
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "config.json"}) {
    bool listed = false;
    for (const auto& file : t.rec.files) listed |= file.first == f;
    if (!listed && exists(dir + "/" + f)) throw FormatError(std::string(f) + " is not among the files trainer.json lists");
  }
  return t;
}

std::vector<std::string> resume_notes(const TrainerRecord& rec, const RunConfig& rc) {
  if (rec.step > rc.steps || (rec.step == rc.steps && !rc.without_steps))
    throw FormatError("the checkpoint is at step " + std::to_string(rec.step) + " and --steps is " +
                      std::to_string(rc.steps) + ": no step would run (--steps is the total, not the steps to add; "
                      "--steps " + std::to_string(rec.step) + " with --eval-every 1 or 01's --sample N reads the "
                      "checkpoint without training)");
  const std::string data = rc.data.empty() ? "synthetic" : rc.data;
  if (rec.has_seed && int64_t(rec.seed) != int64_t(rc.seed) && rec.data == "synthetic" && data == "synthetic")
    throw FormatError("the checkpoint trained on the synthetic source of seed " + std::to_string(int64_t(rec.seed)) +
                      "; --seed " + std::to_string(int64_t(rc.seed)) +
                      " is another source, not a continuation (pass --seed " + std::to_string(int64_t(rec.seed)) + ")");
  std::vector<std::string> notes;
  const std::string from = " from step " + std::to_string(rec.step) + " on";
  if (rec.batch && rec.batch != rc.batch)
    notes.push_back("--batch " + std::to_string(rc.batch) + " (the checkpoint's run used " + std::to_string(rec.batch) +
                    "): each step takes another number of sequences, and" + from +
                    " the windows read differ from the original run's");
  if (rec.seq && rec.seq != rc.model.seq)
    notes.push_back("--seq " + std::to_string(rc.model.seq) + " (the checkpoint's run used " + std::to_string(rec.seq) +
                    "): the weights carry over (RoPE has no length), the windows read" + from + " differ");
  if (!rec.dtype.empty() && rec.dtype != dtype_name(rc.dtype))
    notes.push_back(std::string("--dtype ") + (rc.dtype == DType::F32 ? "fp32" : "bf16") + " (the checkpoint's run used " +
                    rec.dtype + "): the fp32 weights carry over; the curve is not the one the run would have followed");
  if (!rec.data.empty() && rec.data != data)
    notes.push_back("data " + data + " (the checkpoint trained on " + rec.data + "):" + from + " training continues on other data");
  return notes;
}

// Each file whole against the digest trainer.json records, so a checkpoint that mixes two saves
// (or a damaged file) is refused by every rank before any reads its part. The files are shared
// out (rank r hashes files r, r + P, ...) and each process checks a checkpoint once, though ZeRO
// loads it unit by unit: on a shared file system P ranks each reading the whole checkpoint would
// cost P times the I/O. Any rank's mismatch ends every rank with that rank's message.
static void verify_digests(const std::string& dir, const std::vector<std::pair<std::string, std::string>>& files) {
  static std::set<std::string> verified;  // dir and its recorded digests
  std::string key = dir;
  for (const auto& [name, digest] : files) key += "\n" + name + " " + digest;
  if (files.empty() || verified.count(key)) return;
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  std::string err;
  for (size_t i = size_t(rank); i < files.size() && err.empty(); i += size_t(world)) {
    const auto& [name, digest] = files[i];
    std::string got;
    try {
      got = file_digest(dir + "/" + name);
    } catch (const FormatError& e) {
      err = "trainer.json lists " + name + ", which cannot be read: " + e.what();
      break;
    }
    if (got != digest)
      err = name + " has digest " + got + " but trainer.json records " + digest +
            ": the files come from different saves, or one was changed since";
  }
  err = first_error(err, MPI_COMM_WORLD, "checkpoint " + dir + ": file digests");
  if (!err.empty()) {
    if (world == 1) err = err.substr(err.find(": ") + 2);  // "rank 0: " says nothing on one rank
    config_error("checkpoint %s: %s", dir.c_str(), err.c_str());
  }
  verified.insert(key);
}

CheckpointInfo load_checkpoint(const std::string& dir, const ModelConfig& cfg, const ParamTable& table,
                               int64_t begin, int64_t end, const Tensor& weights, AdamW* opt) {
  if (!exists(dir)) config_error("--resume %s: no such checkpoint directory", dir.c_str());
  check_config(dir, cfg);
  CheckpointInfo info;
  // A plain HF model directory has no trainer.json: it loads as the weights of step 0.
  TrainerState t;
  try {
    t = read_trainer(dir);
  } catch (const FormatError& e) {
    config_error("checkpoint %s: %s", dir.c_str(), e.what());
  }
  info.trainer = t.json;
  info.step = t.rec.step;
  verify_digests(dir, t.rec.files);  // the seal, whole, before any tensor is read
  // Names, shapes and dtypes of every tensor, checked by every rank alike before any reads its part.
  auto check_tensors = [&](const SafetensorsReader& r, const char* file, const std::string& prefix) {
    for (const ParamEntry& p : table.entries) {
      const std::string name = prefix + p.name;
      if (!r.has(name)) config_error("checkpoint %s: %s has no tensor %s", dir.c_str(), file, name.c_str());
      const StEntry& e = r.entry(name);
      if (e.shape != p.shape)
        config_error("checkpoint %s: tensor %s has the wrong shape", dir.c_str(), name.c_str());
      if (e.dtype != "F32" && e.dtype != "BF16")
        config_error("checkpoint %s: tensor %s is %s, not F32 or BF16", dir.c_str(), name.c_str(), e.dtype.c_str());
    }
  };
  SafetensorsReader model(dir + "/model.safetensors");
  check_tensors(model, "model.safetensors", "");
  std::vector<float> v(size_t(end - begin));
  read_range(model, table, "", begin, end, v);
  if (weights.defined()) from_host_f32(weights, v.data());
  info.has_optimizer = exists(dir + "/optimizer.safetensors");
  if (opt && info.has_optimizer) {
    SafetensorsReader o(dir + "/optimizer.safetensors");
    for (const char* pre : {"exp_avg.", "exp_avg_sq."}) check_tensors(o, "optimizer.safetensors", pre);
    for (const char* pre : {"exp_avg.", "exp_avg_sq."}) {
      read_range(o, table, pre, begin, end, v);
      from_host_f32(std::string(pre) == "exp_avg." ? opt->m1 : opt->m2, v.data());
    }
  }
  return info;
}

}  // namespace ts
