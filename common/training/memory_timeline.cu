// memory_timeline.cu — --memory-timeline (memory_timeline.h): the allocator's observer and the phases.
#include "training/memory_timeline.h"
#include "tensor/allocator.h"
#include "tensor/hooks.h"
#include "model/model.h"

#include <cstdio>
#include <vector>

namespace ts {

namespace {
struct Event {
  long step;
  int phase;  // index into g_phases
  Device dev;
  Tag tag;
  long long delta;
  size_t current[kNumTags];
};
std::string g_path;
std::vector<std::string> g_phases{"start"};
int g_phase = 0;
size_t g_mark = 0;  // the first event of the current unit (before_unit)
std::vector<Event> g_events;

int phase_id(const std::string& p) {
  for (size_t i = 0; i < g_phases.size(); i++)
    if (g_phases[i] == p) return int(i);
  g_phases.push_back(p);
  return int(g_phases.size()) - 1;
}

// Called by the allocator under its lock, after each allocation and free.
void observe(Device dev, Tag tag, long long delta, const MemStats& s) {
  Event e{current_step(), g_phase, dev, tag, delta, {}};
  for (int t = 0; t < kNumTags; t++) e.current[t] = s.current[t];
  g_events.push_back(e);
}
}  // namespace

bool memory_timeline_on() { return !g_path.empty(); }

void memory_timeline_open(const std::string& path) {
  if (path.empty() || world_rank() != 0) return;
  FILE* f = fopen(path.c_str(), "w");  // created now: a bad path stops the run before its first step
  if (!f) config_error("--memory-timeline %s: cannot create the file", path.c_str());
  fclose(f);
  g_path = path;
  set_alloc_observer(observe);
}

void memory_phase(const std::string& phase) {
  if (!memory_timeline_on()) return;
  g_phase = phase_id(phase);
  g_mark = g_events.size();
}

int memory_phase_now() { return g_phase; }
void memory_phase_resume(int phase) { g_phase = phase; }

void memory_timeline_attach(Model& model) {
  if (!memory_timeline_on()) return;
  model.before_unit.add([](int u) { memory_phase("forward unit " + std::to_string(u)); });
  model.before_backward.add([](int u) {
    const int fwd = phase_id("forward unit " + std::to_string(u)), bwd = phase_id("backward unit " + std::to_string(u));
    for (size_t i = g_mark; i < g_events.size(); i++)
      if (g_events[i].phase == fwd) g_events[i].phase = bwd;
    g_phase = bwd;
  });
}

void memory_timeline_close() {
  if (!memory_timeline_on()) return;
  set_alloc_observer(nullptr);
  FILE* f = fopen(g_path.c_str(), "w");
  if (!f) fatal("--memory-timeline %s: cannot write the file", g_path.c_str());
  fprintf(f, "event,step,phase,device,tag,delta");
  for (int t = 0; t < kNumTags; t++) fprintf(f, ",%s", tag_name(Tag(t)));
  fprintf(f, "\n");
  for (size_t i = 0; i < g_events.size(); i++) {
    const Event& e = g_events[i];
    fprintf(f, "%zu,%ld,%s,%s,%s,%lld", i, e.step, g_phases[size_t(e.phase)].c_str(), device_name(e.dev),
            tag_name(e.tag), e.delta);
    for (int t = 0; t < kNumTags; t++) fprintf(f, ",%zu", e.current[t]);
    fprintf(f, "\n");
  }
  fclose(f);
  g_path.clear();
}

}  // namespace ts
