package kubevirtsim

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
)

func defaultTimings(t *testing.T, o Options) Timings {
	t.Helper()
	if err := o.setDefaults(); err != nil {
		t.Fatal(err)
	}
	return o.Timings
}

// TestPodStartDelayStages: an attachment pod whose volumes are all attached
// on its node already starts in PodStartAttached, one needing an attach in
// PodStartFresh, both plus the creation cost past PodCreateKnee volumes; a
// PodStart the caller set keeps the flat start whatever the pod holds.
func TestPodStartDelayStages(t *testing.T) {
	staged := defaultTimings(t, Options{})
	crowd := func(over int) time.Duration { return time.Duration(over*over) * 30 * time.Millisecond }
	for _, c := range []struct {
		name           string
		t              Timings
		volumes, fresh int
		stage          podStage
		want           time.Duration
	}{
		{"replacement, every volume attached", staged, 3, 0, podStageAttached, 2500 * time.Millisecond},
		{"one volume fresh", staged, 3, 1, podStageFresh, 10 * time.Second},
		{"first pod", staged, 1, 1, podStageFresh, 10 * time.Second},
		{"at the knee", staged, PodCreateKnee, 0, podStageAttached, 2500 * time.Millisecond},
		{"75 volumes, one fresh", staged, 75, 1, podStageFresh, 10*time.Second + crowd(25)},
		{"200 volumes attached", staged, 200, 0, podStageAttached, 2500*time.Millisecond + crowd(150)},
		{"flat, set by the caller", defaultTimings(t, Options{Timings: Timings{PodStart: 8 * time.Second}}), 200, 1, podStageFlat, 8 * time.Second},
		{"flat, at once", defaultTimings(t, Options{Timings: Timings{PodStart: -1}}), 3, 3, podStageFlat, 0},
		{"scaled", defaultTimings(t, Options{Scale: 0.1}), 60, 0, podStageAttached, (2500*time.Millisecond + crowd(10)) / 10},
	} {
		stage, got := podStartDelay(c.t, c.volumes, c.fresh)
		if stage != c.stage || got != c.want {
			t.Errorf("%s: %d volumes, %d fresh: %s %v, want %s %v", c.name, c.volumes, c.fresh, stage, got, c.stage, c.want)
		}
	}
}

// TestPodCreateCostGrowth: no creation cost up to PodCreateKnee volumes,
// then a cost whose every step is larger than the one before (steeper
// than linear), reaching minutes at 200 volumes.
func TestPodCreateCostGrowth(t *testing.T) {
	tm := defaultTimings(t, Options{})
	for n := 0; n <= PodCreateKnee; n++ {
		if c := podCreateCost(tm, n); c != 0 {
			t.Fatalf("%d volumes cost %v, want 0", n, c)
		}
	}
	var step time.Duration
	for n := PodCreateKnee + 1; n <= MaxDisks; n++ {
		d := podCreateCost(tm, n) - podCreateCost(tm, n-1)
		if d <= step {
			t.Fatalf("step to %d volumes %v, not above the step before (%v)", n, d, step)
		}
		step = d
	}
	if c := podCreateCost(tm, 200); c < 10*time.Minute {
		t.Errorf("200 volumes cost %v, want minutes", c)
	}
}

// TestKubeletNotAttached: a claim counts as attached on a node while
// another running attachment pod there mounts it, or for HostRelease after
// the last one is gone; a pending pod never attached anything, and another
// node has nothing.
func TestKubeletNotAttached(t *testing.T) {
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	pod := func(name, node string, phase corev1.PodPhase, claims ...string) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID(name)},
			Spec: corev1.PodSpec{NodeName: node}, Status: corev1.PodStatus{Phase: phase}}
		for _, c := range claims {
			p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: c, VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: c}}})
		}
		return p
	}
	old := pod("old", "node-0", corev1.PodRunning, "pvc-a", "pvc-b")
	pending := pod("pending", "node-0", corev1.PodPending, "pvc-c")
	for _, p := range []*corev1.Pod{old, pending} {
		if err := idx.Add(p); err != nil {
			t.Fatal(err)
		}
	}
	k := &kubelet{c: &cluster{t: defaultTimings(t, Options{}), podLister: corelisters.NewPodLister(idx)}, released: map[string]time.Time{}}
	now := time.Now()
	check := func(p *corev1.Pod, at time.Time, want int) {
		t.Helper()
		if got := k.notAttached(p, podClaims(p), at); got != want {
			t.Errorf("pod %s on %s at +%v: %d volumes not attached, want %d", p.Name, p.Spec.NodeName, at.Sub(now), got, want)
		}
	}
	add := pod("add", "node-0", corev1.PodPending, "pvc-a", "pvc-b", "pvc-c", "pvc-d")
	check(add, now, 2) // pvc-c is only in a pending pod, pvc-d nowhere
	check(pod("shrink", "node-0", corev1.PodPending, "pvc-a"), now, 0)
	check(pod("elsewhere", "node-1", corev1.PodPending, "pvc-a"), now, 1)
	check(old, now, 2) // a pod does not hold its own volumes

	if err := idx.Delete(old); err != nil {
		t.Fatal(err)
	}
	k.release(old, now)
	k.release(pending, now)
	check(add, now.Add(time.Second), 2)
	check(add, now.Add(k.c.t.HostRelease), 4)
}
