package monitor

import (
	"testing"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/invariants"
)

func va(name, vol string, created time.Time) *storagev1.VolumeAttachment {
	return &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: name, CreationTimestamp: metav1.NewTime(created)},
		Spec:       storagev1.VolumeAttachmentSpec{NodeName: "node-0", Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(vol)}},
	}
}

func newMonitor() *Monitor {
	return &Monitor{
		vaCreated: map[string]time.Time{}, vaAttached: map[string]bool{}, vaDeleting: map[string]time.Time{},
		vaInfo: map[string]invariants.Pair{}, vaErr: map[string]string{},
		podCreated: map[string]time.Time{}, podScheduled: map[string]time.Time{}, podRunning: map[string]bool{},
		podInfo: map[string]podInfo{}, jobsDone: map[string]bool{}, AttacherErrors: map[string]int{},
	}
}

func TestAttachDetachLatencyAndErrors(t *testing.T) {
	m := newMonitor()
	created := time.Now().Add(-3 * time.Second)
	a := va("csi-a", "pvc-11111111-2222-3333-4444-555555555555", created)
	m.va(a, false)
	if s := m.Snapshot(); s.Attaching != 1 || len(m.Pending()) != 1 {
		t.Fatalf("a new VA is attaching: %+v", s)
	}
	a.Status.AttachError = &storagev1.VolumeError{Message: "volume pvc-11111111-2222-3333-4444-555555555555 is attached on VM node-1"}
	m.va(a, false)
	m.va(a, false) // the same message again on the same VA counts once
	b := va("csi-b", "pvc-66666666-2222-3333-4444-555555555555", created)
	b.Status.AttachError = &storagev1.VolumeError{Message: "volume pvc-66666666-2222-3333-4444-555555555555 is attached on VM node-1"}
	m.va(b, false)
	if got := m.Snapshot().AttacherErrors["volume <volume> is attached on VM node-1"]; got != 2 {
		t.Fatalf("errors %v: want one kind seen twice", m.Snapshot().AttacherErrors)
	}
	a.Status.Attached = true
	m.va(a, false)
	s := m.Snapshot()
	if s.Attaches != 1 || len(s.Attach) != 1 || s.Attach[0].Seconds < 3 {
		t.Fatalf("attach not measured from creation: %+v", s)
	}
	now := metav1.Now()
	a.DeletionTimestamp = &now
	m.va(a, false)
	if s := m.Snapshot(); s.Detaching != 1 {
		t.Fatalf("a deleted VA is detaching: %+v", s)
	}
	m.va(a, true)
	if s := m.Snapshot(); s.Detaches != 1 || s.Detaching != 0 || len(s.Detach) != 1 {
		t.Fatalf("detach not measured: %+v", s)
	}
}

func TestSummarize(t *testing.T) {
	var ss []Sample
	for i := 1; i <= 100; i++ {
		ss = append(ss, Sample{Seconds: float64(i)})
	}
	p := Summarize(ss)
	if p.P50 < 49 || p.P50 > 51 || p.P99 < 98 || p.Max != 100 || p.N != 100 {
		t.Fatalf("%+v", p)
	}
	if (Summarize(nil) != Percentiles{}) {
		t.Fatal("no samples, no figures")
	}
}

// TestSummarizeIsNearestRank: the lab's figures use the benchmarks' percentile
// (nearest rank), so the two can stand side by side in docs/benchmarks.md.
func TestSummarizeIsNearestRank(t *testing.T) {
	var ss []Sample
	for i := 1; i <= 10; i++ {
		ss = append(ss, Sample{Seconds: float64(i)})
	}
	if p := Summarize(ss); p.P50 != 5 || p.P95 != 10 || p.P99 != 10 {
		t.Fatalf("%+v, want p50 5 (five of ten samples are at or below it), p95 and p99 10", p)
	}
}

// Each attach and detach carries the case named when it started, not when
// it ended, and the classifier is asked once per operation.
func TestAttachAndDetachCarryTheCaseOfTheirStart(t *testing.T) {
	m := newMonitor()
	m.vaCase, m.vaDetachCase = map[string]string{}, map[string]string{}
	state, calls := "moved", 0
	m.classify = func(_ *storagev1.VolumeAttachment, detach bool) string {
		calls++
		if detach {
			return "detach-" + state
		}
		return state
	}
	a := va("csi-a", "pvc-a", time.Now())
	m.va(a, false)
	state = "on-host-node" // the host let go meanwhile: the attach stays a move
	m.va(a, false)
	a.Status.Attached = true
	m.va(a, false)
	now := metav1.Now()
	a.DeletionTimestamp = &now
	m.va(a, false)
	state = "fresh"
	m.va(a, false)
	m.va(a, true)
	s := m.Snapshot()
	if len(s.Attach) != 1 || s.Attach[0].Case != "moved" {
		t.Errorf("attach samples %+v, want one of case moved", s.Attach)
	}
	if len(s.Detach) != 1 || s.Detach[0].Case != "detach-on-host-node" {
		t.Errorf("detach samples %+v, want one of case detach-on-host-node", s.Detach)
	}
	if calls != 2 {
		t.Errorf("classifier asked %d times, want once per operation", calls)
	}
}
