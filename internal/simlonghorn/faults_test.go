package simlonghorn

import (
	"context"
	"math/rand"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// bareSim is a stand-in with no API server behind it, for the switches that
// only change its own state.
func bareSim(opts Options) *Sim {
	return &Sim{opts: opts, rng: rand.New(rand.NewSource(1)), stages: map[string]*stage{}, //nolint:gosec // jitter
		faulted: map[string]time.Time{}, lag: map[string]*lagging{}, ghosts: map[string]WorkloadStatus{}, cleared: map[string]WorkloadStatus{},
		slowDetach: opts.Faults.SlowDetach}
}

// The lab slows the host's teardown for a while and then lets it go back
// to normal: the detach stage follows the switch while the stand-in runs.
func TestSetSlowDetachWhileRunning(t *testing.T) {
	s := bareSim(Options{Scale: 1, Faults: Faults{SlowDetach: 2}})
	if got := s.detachTime(); got != 2*realDetach {
		t.Fatalf("Faults.SlowDetach 2: detach %s, want %s", got, 2*realDetach)
	}
	s.SetSlowDetach(10)
	if got := s.detachTime(); got != 10*realDetach {
		t.Errorf("SetSlowDetach(10): detach %s, want %s", got, 10*realDetach)
	}
	s.SetSlowDetach(0)
	if got := s.detachTime(); got != realDetach {
		t.Errorf("SetSlowDetach(0): detach %s, want the normal %s", got, realDetach)
	}
}

// A fault on the lab's wall-clock schedule ends when the lab says, whatever
// the stand-in's scale, and the volume comes due for a pass then.
func TestFaultVolumeUntilIsOnTheWallClock(t *testing.T) {
	s := bareSim(Options{Scale: 0.01})
	now := time.Now()
	until := now.Add(time.Minute)
	s.FaultVolumeUntil("vol", until)
	if !s.isFaulted("vol", now) || !s.isFaulted("vol", until.Add(-time.Millisecond)) {
		t.Fatal("not faulted before the end the lab gave")
	}
	if s.isFaulted("vol", until) {
		t.Error("still faulted at the end the lab gave")
	}
	if d, ok := s.nextDue("vol", now); !ok || d != time.Minute {
		t.Errorf("next pass in %s (%v), want at the fault's end, in 1m", d, ok)
	}
}

// A ghost entry the lab takes away leaves the workloads list (after the
// list's lag) even while no pod uses the volume, when the stand-in
// otherwise keeps the old list as Longhorn does: the fault has an end.
func TestGhostRemovedLeavesTheListWithNoPod(t *testing.T) {
	s := bareSim(Options{Scale: 1, WorkloadsLag: time.Nanosecond})
	ghost := WorkloadStatus{PodName: "hp-volume-gone", PodStatus: "Succeeded"}
	old := WorkloadStatus{PodName: "hp-volume-old", PodStatus: "Running"}
	v := &Volume{}
	v.Name = "vol"
	v.Status.KubernetesStatus = KubernetesStatus{Namespace: "ns", PVCName: "claim"}
	p := &pass{pods: map[string][]corev1.Pod{"ns": nil}} // no pod uses the claim
	follow := func(now time.Time) {
		t.Helper()
		if err := s.followWorkloads(context.Background(), p, v, now); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now()
	v.Status.KubernetesStatus.WorkloadsStatus = []WorkloadStatus{old}
	s.SetGhostWorkload("vol", ghost)
	follow(now)
	follow(now.Add(time.Second))
	if got := v.Status.KubernetesStatus.WorkloadsStatus; len(got) != 2 || got[1] != ghost {
		t.Fatalf("with the ghost: %+v, want the old entry and the ghost", got)
	}
	s.SetGhostWorkload("vol", WorkloadStatus{})
	follow(now.Add(2 * time.Second))
	follow(now.Add(3 * time.Second))
	if got := v.Status.KubernetesStatus.WorkloadsStatus; len(got) != 1 || got[0] != old {
		t.Errorf("ghost taken away: %+v, want the old entry only", got)
	}
}

// A ghost entry outlives its pod only while Longhorn's PV controller has
// not rebuilt the list: setWorkloads replaces the whole list whenever a pod
// uses the claim (longhorn-manager v1.10.1
// controller/kubernetes_pv_controller.go:469-478). So while the ghost is
// there the list does not follow pods, and a new attachment pod's
// NodePublish finds no Pending pod listed and is refused; once the ghost
// goes, the list catches up with the pods.
func TestGhostListDoesNotFollowANewPod(t *testing.T) {
	s := bareSim(Options{Scale: 1, WorkloadsLag: time.Nanosecond})
	ghost := WorkloadStatus{PodName: "hp-volume-gone", PodStatus: "Succeeded"}
	old := WorkloadStatus{PodName: "hp-volume-old", PodStatus: "Running"}
	v := &Volume{}
	v.Name = "vol"
	v.Status.KubernetesStatus = KubernetesStatus{Namespace: "ns", PVCName: "claim", WorkloadsStatus: []WorkloadStatus{old}}
	pod := func(name string, phase corev1.PodPhase) corev1.Pod {
		p := corev1.Pod{Spec: corev1.PodSpec{Volumes: []corev1.Volume{{Name: "v",
			VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "claim"}}}}}}
		p.Name, p.Status.Phase = name, phase
		return p
	}
	p := &pass{pods: map[string][]corev1.Pod{"ns": {pod("hp-volume-old", corev1.PodRunning), pod("hp-volume-new", corev1.PodPending)}}}
	follow := func(now time.Time) {
		t.Helper()
		if err := s.followWorkloads(context.Background(), p, v, now); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now()
	s.SetGhostWorkload("vol", ghost)
	follow(now)
	follow(now.Add(time.Second))
	got := v.Status.KubernetesStatus.WorkloadsStatus
	if len(got) != 2 || got[0] != old || got[1] != ghost {
		t.Fatalf("with the ghost and a new Pending pod: %+v, want the old entry and the ghost only", got)
	}
	if publishable(got) {
		t.Errorf("NodePublish allowed with %+v, want Aborted (no Pending pod listed)", got)
	}
	s.SetGhostWorkload("vol", WorkloadStatus{})
	follow(now.Add(2 * time.Second))
	follow(now.Add(3 * time.Second))
	got = v.Status.KubernetesStatus.WorkloadsStatus
	if len(got) != 2 || got[0].PodName != "hp-volume-old" || got[1].PodName != "hp-volume-new" || !publishable(got) {
		t.Errorf("ghost gone: %+v, want the two pods, publishable", got)
	}
}
