// pipecc's own hls::stream stand-in for C simulation with g++ (written for pipecc, Apache-2.0;
// not Xilinx's header). Vitis HLS uses its own hls_stream.h: this file lives in csim_include/,
// which only pipecc's g++ build puts on the include path.
//
// Two modes (hls::csim::configure):
//   sequential (default)  unbounded FIFOs; DATAFLOW processes run one after another, in order.
//                         Reading an empty stream is an error (the producer has not run).
//   threaded              every DATAFLOW process runs in its own thread and every FIFO holds at
//                         most its declared depth (PIPECC_SET_DEPTH, or an override). When every
//                         live process is blocked, that is a deadlock: the report lists each
//                         FIFO's occupancy/depth and who is blocked where, and Dataflow::run
//                         throws hls::csim::Deadlock.
// Both modes record each FIFO's high-water mark: the occupancy that sizes its depth.
#ifndef PIPECC_HLS_STREAM_H
#define PIPECC_HLS_STREAM_H
#define PIPECC_CSIM_STREAM 1

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace hls {
namespace csim {

struct Deadlock : std::runtime_error {
  explicit Deadlock(const std::string& what) : std::runtime_error(what) {}
};

class StreamBase {
 public:
  virtual ~StreamBase() {}
  virtual std::string name() const = 0;
  virtual size_t occupancy() const = 0;  // call with state().mu held
  virtual size_t bound() const = 0;      // 0: unbounded
  std::condition_variable cv;
};

struct FifoStat {
  bool declared = false;  // an internal FIFO of the design (not a port or a host buffer)
  size_t depth = 0;
  size_t high_water = 0;
};

struct Waiter {
  StreamBase* fifo;
  bool reading;      // blocked reading an empty FIFO (else writing a full one)
  std::string text;  // for the report
};

struct State {
  std::mutex mu;
  bool threaded = false;
  size_t depth_all = 0;                       // override every declared depth (0: keep)
  std::map<std::string, size_t> depth_named;  // override one FIFO's depth
  int alive = 0;                              // DATAFLOW threads still running
  bool deadlock = false;
  std::string report;
  std::vector<StreamBase*> live;
  std::map<std::string, FifoStat> stats;      // by FIFO name, across calls
  std::map<std::thread::id, Waiter> waiting;  // who waits where
};

inline State& state() {
  static State s;
  return s;
}

inline std::string& current_process() {
  static thread_local std::string name = "main";
  return name;
}

// Build the deadlock report and wake every waiter. Call with state().mu held.
inline void declare_deadlock(State& st, const std::string& why) {
  if (st.deadlock) return;
  st.deadlock = true;
  std::ostringstream r;
  r << "DEADLOCK: " << why << "\n";
  for (auto& w : st.waiting) r << "  blocked: " << w.second.text << "\n";
  for (StreamBase* s : st.live) {
    if (s->bound() == 0) continue;
    r << "  fifo " << s->name() << ": " << s->occupancy() << "/" << s->bound() << "\n";
  }
  st.report = r.str();
  for (StreamBase* s : st.live) s->cv.notify_all();
}

// Deadlock: every running process waits, and no wait can be satisfied (a waiter that was
// notified but has not woken yet still counts as able to go on). Call with state().mu held.
inline void check_deadlock(State& st, const std::string& why) {
  if (st.deadlock || st.alive == 0 || (int)st.waiting.size() != st.alive) return;
  for (auto& w : st.waiting) {
    StreamBase* f = w.second.fifo;
    if (w.second.reading ? f->occupancy() > 0 : (f->bound() == 0 || f->occupancy() < f->bound()))
      return;
  }
  declare_deadlock(st, why);
}

inline void configure(bool threaded, size_t depth_all) {
  State& st = state();
  std::lock_guard<std::mutex> lk(st.mu);
  st.threaded = threaded;
  st.depth_all = depth_all;
  st.depth_named.clear();
  st.stats.clear();
}

inline void set_fifo_depth(const std::string& name, size_t depth) {
  std::lock_guard<std::mutex> lk(state().mu);
  state().depth_named[name] = depth;
}

// The DATAFLOW region of one call of the top function.
class Dataflow {
 public:
  void add(const char* name, std::function<void()> body) { procs_.emplace_back(name, body); }

  void run() {
    State& st = state();
    if (!st.threaded) {
      for (auto& p : procs_) {
        current_process() = p.first;
        p.second();
      }
      current_process() = "main";
      return;
    }
    {
      std::lock_guard<std::mutex> lk(st.mu);
      st.alive = static_cast<int>(procs_.size());
      st.deadlock = false;
      st.report.clear();
      st.waiting.clear();
    }
    std::vector<std::thread> threads;
    std::exception_ptr error;
    std::mutex error_mu;
    for (auto& p : procs_) {
      threads.emplace_back([&st, &p, &error, &error_mu]() {
        current_process() = p.first;
        try {
          p.second();
        } catch (const Deadlock&) {
        } catch (...) {
          std::lock_guard<std::mutex> lk(error_mu);
          if (!error) error = std::current_exception();
        }
        std::lock_guard<std::mutex> lk(st.mu);
        st.alive--;
        check_deadlock(st, "process " + p.first + " finished; every other process is blocked");
      });
    }
    for (auto& t : threads) t.join();
    if (st.deadlock) throw Deadlock(st.report);
    if (error) std::rethrow_exception(error);
  }

 private:
  std::vector<std::pair<std::string, std::function<void()>>> procs_;
};

}  // namespace csim

template <class T>
class stream : public csim::StreamBase {
 public:
  stream() : name_("stream") { enroll(); }
  explicit stream(const char* name) : name_(name) { enroll(); }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() {
    csim::State& st = csim::state();
    std::lock_guard<std::mutex> lk(st.mu);
    for (size_t i = 0; i < st.live.size(); i++)
      if (st.live[i] == this) st.live.erase(st.live.begin() + i);
  }

  // Declared FIFO depth (0: unbounded, as for top-level ports). Bounded in threaded mode only.
  void set_depth(size_t depth) {
    std::lock_guard<std::mutex> lk(csim::state().mu);
    declared_ = depth;
    csim::FifoStat& s = csim::state().stats[name_];
    s.depth = csim::state().threaded ? bound() : declared_;
    s.declared = true;
  }

  std::string name() const override { return name_; }
  size_t occupancy() const override { return q_.size(); }
  size_t bound() const override {
    const csim::State& st = csim::state();
    if (!st.threaded || declared_ == 0) return 0;
    auto it = st.depth_named.find(name_);
    if (it != st.depth_named.end()) return it->second;
    return st.depth_all ? st.depth_all : declared_;
  }

  void write(const T& value) {
    csim::State& st = csim::state();
    std::unique_lock<std::mutex> lk(st.mu);
    wait(lk, false, [this]() { return bound() == 0 || q_.size() < bound(); });
    q_.push_back(value);
    csim::FifoStat& s = st.stats[name_];
    if (q_.size() > s.high_water) s.high_water = q_.size();
    cv.notify_all();
  }

  T read() {
    csim::State& st = csim::state();
    std::unique_lock<std::mutex> lk(st.mu);
    if (!st.threaded && q_.empty())
      throw std::runtime_error("read from empty stream " + name_ + " in process " +
                               csim::current_process() + " (sequential C simulation)");
    wait(lk, true, [this]() { return !q_.empty(); });
    T value = q_.front();
    q_.pop_front();
    cv.notify_all();
    return value;
  }

  void read(T& value) { value = read(); }
  void operator>>(T& value) { value = read(); }
  void operator<<(const T& value) { write(value); }
  bool empty() const {
    std::lock_guard<std::mutex> lk(csim::state().mu);
    return q_.empty();
  }
  bool full() const {
    std::lock_guard<std::mutex> lk(csim::state().mu);
    return bound() != 0 && q_.size() >= bound();
  }
  size_t size() const {
    std::lock_guard<std::mutex> lk(csim::state().mu);
    return q_.size();
  }

 private:
  template <class Ready>
  void wait(std::unique_lock<std::mutex>& lk, bool reading, Ready ready) {
    csim::State& st = csim::state();
    if (ready()) return;
    const std::thread::id me = std::this_thread::get_id();
    st.waiting[me] = csim::Waiter{this, reading, csim::current_process() +
                                  (reading ? ": read from empty" : ": write to full") +
                                  " fifo " + name_};
    while (!st.deadlock && !ready()) {
      csim::check_deadlock(st, "every process is blocked on a FIFO");
      if (!st.deadlock) cv.wait(lk);
    }
    st.waiting.erase(me);
    if (st.deadlock) throw csim::Deadlock(st.report);
  }

  void enroll() {
    std::lock_guard<std::mutex> lk(csim::state().mu);
    csim::state().live.push_back(this);
  }

  std::string name_;
  size_t declared_ = 0;
  std::deque<T> q_;
};

}  // namespace hls

#endif  // PIPECC_HLS_STREAM_H
