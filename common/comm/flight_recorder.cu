// flight_recorder.cu — the per-rank ring of collectives and point-to-point calls, its dump, and the
// request that makes every live rank dump when one of them times out or fails.
#include "comm/flight_recorder.h"
#include "tensor/hooks.h"

#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <vector>

#include "formats/json.h"

namespace ts::flight {

namespace {

enum class State : uint8_t { Enqueued, Started, Completed };
const char* state_name(State s) {
  return s == State::Enqueued ? "enqueued" : s == State::Started ? "started" : "completed";
}

struct Group {
  std::string name;
  std::vector<int> ranks;  // world rank of each group rank
  int instance = 0;        // how many groups of this name and membership this rank registered before
  long collectives = 0;    // collectives issued on it so far
  std::map<std::tuple<int, int, int>, long> messages;  // (src, dst, tag) -> messages so far
};

struct Entry {
  uint64_t id = 0;  // 1, 2, ... on this rank; 0: an empty slot
  int group = -1;
  bool p2p = false;
  long seq = 0;
  const char* op = "";
  int peer = -1, tag = -1, root = -1;  // group ranks
  int64_t count = 0, bytes = 0;
  const char* dtype = "";  // a literal: recording allocates only `what`
  std::string what;
  long step = -1;
  State state = State::Enqueued;
  double t_enqueued = 0, t_started = 0, t_completed = 0;
};

struct Recorder {
  int capacity = 2000;
  std::string dir = "tinyscale-flight";
  std::vector<Entry> ring;
  uint64_t next_id = 1;
  std::vector<Group> groups;               // every group ever registered, by index
  std::map<MPI_Comm, int> live;            // communicator -> its current group
  MPI_Comm channel = MPI_COMM_NULL;        // the dump requests' own communicator
  MPI_Request request = MPI_REQUEST_NULL;  // the pre-posted receive of a request
  int request_from = -1;
  bool dumping = false;
};
Recorder& R() {
  static Recorder r;
  return r;
}

std::atomic<bool> g_usr1{false};
void on_usr1(int) { g_usr1 = true; }

constexpr int kTagRequest = 1, kTagAnswer = 2;
int g_me = 0;  // the requests' payload: outlives the sends, which are never waited for

double now() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);  // comparable across the ranks of one machine (and NTP'd ones)
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

bool mpi_up() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

int group_index(MPI_Comm comm) {
  Recorder& r = R();
  auto it = r.live.find(comm);
  if (it != r.live.end()) return it->second;
  char name[MPI_MAX_OBJECT_NAME] = "";
  int n = 0;
  if (comm == MPI_COMM_WORLD) snprintf(name, sizeof name, "world");
  else MPI_Comm_get_name(comm, name, &n);
  register_group(comm, name[0] ? name : "unnamed");
  return r.live[comm];
}

void serve_signal() {
  if (g_usr1.exchange(false)) {
    const std::string path = dump("SIGUSR1");
    if (!path.empty()) fprintf(stderr, "flight recorder: SIGUSR1: rank %d wrote %s\n", world_rank(), path.c_str());
  }
}

Entry* slot(uint64_t id) {
  Recorder& r = R();
  if (id == 0 || r.ring.empty()) return nullptr;
  Entry& e = r.ring[id % r.ring.size()];
  return e.id == id ? &e : nullptr;  // overwritten since: nothing to update
}

uint64_t add(int group, bool p2p, long seq, const char* op, int peer, int tag, int root, int64_t count,
             int64_t bytes, const char* dtype, const std::string& what) {
  Recorder& r = R();
  serve_signal();  // not the request channel: an MPI call here would progress the caller's transfers
  if (r.capacity <= 0) return 0;
  if (r.ring.size() != size_t(r.capacity)) r.ring.assign(size_t(r.capacity), Entry{});
  const uint64_t id = r.next_id++;
  Entry& e = r.ring[id % r.ring.size()];
  e.id = id, e.group = group, e.p2p = p2p, e.seq = seq, e.op = op, e.peer = peer, e.tag = tag, e.root = root;
  e.count = count, e.bytes = bytes, e.dtype = dtype, e.what = what, e.step = current_step();
  e.state = State::Enqueued, e.t_enqueued = now(), e.t_started = e.t_completed = 0;
  return id;
}

const char* mpi_type_name(MPI_Datatype t) {
  if (t == MPI_INT) return "i32";
  if (t == MPI_DOUBLE) return "f64";
  if (t == MPI_FLOAT) return "f32";
  if (t == MPI_LONG || t == MPI_INT64_T) return "i64";
  if (t == MPI_CHAR || t == MPI_BYTE) return "u8";
  return "other";
}

Json entry_json(const Entry& e) {
  Json j = Json::object();
  j["id"] = int64_t(e.id);
  j["group"] = e.group;
  j["kind"] = e.p2p ? "p2p" : "collective";
  j["seq"] = e.seq;
  j["op"] = e.op;
  if (e.p2p) j["peer"] = e.peer, j["tag"] = e.tag;
  if (e.root >= 0) j["root"] = e.root;
  j["count"] = e.count;
  j["dtype"] = e.dtype;
  j["bytes"] = e.bytes;
  j["state"] = state_name(e.state);
  j["step"] = e.step;
  auto t = [](double v) { return v > 0 ? Json(v) : Json(nullptr); };
  j["t_enqueued"] = t(e.t_enqueued);
  j["t_started"] = t(e.t_started);
  j["t_completed"] = t(e.t_completed);
  j["what"] = e.what;
  return j;
}

Json dump_json(const std::string& reason) {
  Recorder& r = R();
  Json j = Json::object();
  j["version"] = 1;
  int world = 1;
  if (mpi_up()) MPI_Comm_size(MPI_COMM_WORLD, &world);
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  j["rank"] = world_rank(), j["world"] = world, j["pid"] = int(getpid()), j["host"] = host;
  j["reason"] = reason, j["step"] = current_step(), j["time"] = now();
  j["capacity"] = r.capacity;
  j["recorded"] = int64_t(r.next_id - 1);
  j["dropped"] = int64_t(r.next_id - 1 > r.ring.size() ? r.next_id - 1 - r.ring.size() : 0);
  Json groups = Json::array();
  for (size_t g = 0; g < r.groups.size(); g++) {
    Json gj = Json::object(), ranks = Json::array();
    for (int w : r.groups[g].ranks) ranks.push_back(w);
    gj["id"] = int(g), gj["name"] = r.groups[g].name, gj["ranks"] = ranks, gj["instance"] = r.groups[g].instance;
    groups.push_back(gj);
  }
  j["groups"] = groups;
  Json entries = Json::array();  // oldest first
  for (uint64_t id = r.next_id > r.ring.size() ? r.next_id - r.ring.size() : 1; id < r.next_id; id++)
    if (const Entry* e = slot(id)) entries.push_back(entry_json(*e));
  j["entries"] = entries;
  return j;
}

// Answers another rank's request (once: later requests find the dump done).
void serve_request() {
  Recorder& r = R();
  if (r.request == MPI_REQUEST_NULL) return;
  int flag = 0;
  if (MPI_Test(&r.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag) return;
  char why[64];
  snprintf(why, sizeof why, "asked by rank %d", r.request_from);
  dump(why);
  static int done = 1;  // outlives the send, which is never waited for
  MPI_Request ack;
  MPI_Isend(&done, 1, MPI_INT, r.request_from, kTagAnswer, r.channel, &ack);
  MPI_Request_free(&ack);  // a one-int eager message; the requester may already be gone
}

}  // namespace

void configure(int capacity, const std::string& dir) {
  R().capacity = capacity;
  if (!dir.empty()) R().dir = dir;
  R().ring.clear();
}

void open_channel(MPI_Comm channel) {
  Recorder& r = R();
  signal(SIGUSR1, on_usr1);
  r.channel = channel;
  MPI_Comm_set_errhandler(r.channel, MPI_ERRORS_RETURN);
  MPI_Irecv(&r.request_from, 1, MPI_INT, MPI_ANY_SOURCE, kTagRequest, r.channel, &r.request);
}

void register_group(MPI_Comm comm, const std::string& name) {
  Recorder& r = R();
  if (!mpi_up()) return;
  Group g;
  g.name = name;
  int n = 1;
  MPI_Comm_size(comm, &n);
  MPI_Group mine, world;
  MPI_Comm_group(comm, &mine);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> local(static_cast<size_t>(n));
  for (int i = 0; i < n; i++) local[size_t(i)] = i;
  g.ranks.resize(size_t(n));
  MPI_Group_translate_ranks(mine, n, local.data(), world, g.ranks.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
  for (const Group& o : r.groups) g.instance += o.name == g.name && o.ranks == g.ranks;
  r.groups.push_back(std::move(g));
  r.live[comm] = int(r.groups.size()) - 1;
}

void forget_group(MPI_Comm comm) { R().live.erase(comm); }

namespace {
// The next collective on comm, numbered, into the ring.
uint64_t add_collective(MPI_Comm comm, const char* op, int64_t count, int64_t bytes, const char* dtype, int root,
                        const std::string& what) {
  const int gi = group_index(comm);
  const long n = ++R().groups[size_t(gi)].collectives;
  return add(gi, false, n, op, -1, -1, root, count, bytes, dtype, what);
}
}  // namespace

uint64_t collective(MPI_Comm comm, const char* op, int64_t count, DType dtype, int root, const std::string& what) {
  return add_collective(comm, op, count, count * int64_t(dtype_size(dtype)), dtype_name(dtype), root, what);
}

uint64_t collective_raw(MPI_Comm comm, const char* op, int64_t count, MPI_Datatype type, int root,
                        const std::string& what) {
  int size = 0;
  if (type != MPI_DATATYPE_NULL) MPI_Type_size(type, &size);
  return add_collective(comm, op, count, count * size, type == MPI_DATATYPE_NULL ? "none" : mpi_type_name(type), root,
                        what);
}

uint64_t p2p(MPI_Comm comm, const char* op, int peer, int tag, int64_t count, DType dtype, const std::string& what) {
  const int gi = group_index(comm);
  Group& g = R().groups[size_t(gi)];
  int me = 0;
  MPI_Comm_rank(comm, &me);
  const bool send = op[0] == 's';
  const long n = ++g.messages[{send ? me : peer, send ? peer : me, tag}];
  return add(gi, true, n, op, peer, tag, -1, count, count * int64_t(dtype_size(dtype)), dtype_name(dtype), what);
}

long next_collective(MPI_Comm comm) { return R().groups[size_t(group_index(comm))].collectives + 1; }

long next_message(MPI_Comm comm, int src, int dst, int tag) {
  const auto& m = R().groups[size_t(group_index(comm))].messages;
  auto it = m.find({src, dst, tag});
  return (it == m.end() ? 0 : it->second) + 1;
}

void started(uint64_t id) {
  if (Entry* e = slot(id))
    if (e->state == State::Enqueued) e->state = State::Started, e->t_started = now();
}

void completed(uint64_t id) {
  if (Entry* e = slot(id)) {
    if (e->t_started == 0) e->t_started = now();
    e->state = State::Completed, e->t_completed = now();
  }
}

// A receive withdrawn: a cancelled request completes locally, at once.
static void cancel(MPI_Request& q) {
  if (q == MPI_REQUEST_NULL) return;
  MPI_Cancel(&q);
  for (int done = 0; !done;)
    if (MPI_Test(&q, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
}

void shutdown() {
  Recorder& r = R();
  if (!mpi_up() || r.channel == MPI_COMM_NULL) return;
  cancel(r.request);
  MPI_Comm_free(&r.channel);
}

void poll() {
  serve_signal();
  if (R().request != MPI_REQUEST_NULL) serve_request();
}

std::string dump(const std::string& reason) {
  Recorder& r = R();
  if (r.capacity <= 0 || r.dumping) return "";
  r.dumping = true;  // a failure while dumping must not dump again
  mkdir(r.dir.c_str(), 0755);
  const std::string path = r.dir + "/rank_" + std::to_string(world_rank()) + ".json";
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const std::string text = dump_json(reason).dump(1) + "\n";
  FILE* f = fopen(tmp.c_str(), "w");
  bool ok = f && fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = (f && fclose(f) == 0) && ok;
  ok = ok && rename(tmp.c_str(), path.c_str()) == 0;
  if (!ok) {
    fprintf(stderr, "flight recorder: rank %d cannot write %s: %s\n", world_rank(), path.c_str(), strerror(errno));
    unlink(tmp.c_str());
  }
  r.dumping = false;
  return ok ? path : "";
}

void dump_everywhere(const std::string& reason, bool mpi_usable, double grace_s) {
  Recorder& r = R();
  if (r.capacity <= 0 || r.dumping) return;
  const std::string mine = dump(reason);
  if (mine.empty()) return;
  int world = 1, answered = 0;
  if (mpi_usable && r.channel != MPI_COMM_NULL) {
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const int me = world_rank();
    g_me = me;
    // One request to each other rank, one receive posted for each answer.
    std::vector<MPI_Request> asks, answers;
    std::vector<int> got(size_t(world), 0);
    for (int q = 0; q < world; q++)
      if (q != me) {
        asks.push_back(MPI_REQUEST_NULL);
        MPI_Isend(&g_me, 1, MPI_INT, q, kTagRequest, r.channel, &asks.back());
        answers.push_back(MPI_REQUEST_NULL);
        MPI_Irecv(&got[size_t(q)], 1, MPI_INT, q, kTagAnswer, r.channel, &answers.back());
      }
    // The others answer from their wait loops; a stopped or lost rank never does.
    const double until = now() + grace_s;
    while (answered < world - 1 && now() < until) {
      int n = 0;
      std::vector<int> which(answers.size());
      MPI_Testsome(int(answers.size()), answers.data(), &n, which.data(), MPI_STATUSES_IGNORE);
      if (n == MPI_UNDEFINED) break;
      answered += n;
      if (n == 0) usleep(1000);
    }
    for (MPI_Request& q : answers) cancel(q);
    for (MPI_Request& q : asks) MPI_Request_free(&q);
  }
  fprintf(stderr, "flight recorder: rank %d wrote %s; %d of the other %d ranks wrote theirs; read them with "
                  "scripts/flight_analyze.py %s\n",
          world_rank(), mine.c_str(), answered, world - 1, r.dir.c_str());
}

}  // namespace ts::flight
