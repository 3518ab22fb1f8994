package kubevirtsim

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// The contract tests pin, per KubeVirt version, the behaviours the package
// doc lists (numbered as there). Each subtest runs its own simulator.

// perVersion runs f for each version as a parallel subtest.
func perVersion(t *testing.T, versions []Version, f func(t *testing.T, v Version)) {
	t.Helper()
	for _, v := range versions {
		t.Run(string(v), func(t *testing.T) {
			t.Parallel()
			f(t, v)
		})
	}
}

// declarativeVersions are those with the DeclarativeHotplugVolumes gate.
func declarativeVersions() []Version { return []Version{V1_6_3, V1_7_0, V1_8_2, VMain} }

// scene starts a legacy simulator of version v (plus opts) with a running
// VM "vm1" and bound claims.
func scene(t *testing.T, v Version, opts Options, claims ...string) (*Sim, string, context.Context) {
	t.Helper()
	opts.Version = v
	s, ns := testSim(t, opts)
	ctx := testCtx(t, 2*time.Minute)
	vmWithClaims(ctx, t, s, ns, "vm1", claims...)
	return s, ns, ctx
}

// waitEntry waits until cond holds for the VMI and the volume's entry
// (ok=false when there is none).
func waitEntry(t *testing.T, s *Sim, ns, volume, what string, cond func(vmi *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool) {
	t.Helper()
	err := s.Wait(testCtx(t, 60*time.Second), ns, "vm1", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
		if vmi == nil {
			return false
		}
		e, ok := FindVolumeStatus(vmi, volume)
		return cond(vmi, e, ok)
	})
	if err != nil {
		_, vmi := s.VM(ns, "vm1")
		t.Fatalf("%s: %v\n%s", what, err, describe(s, vmi))
	}
}

func phaseIs(p kubevirtv1.VolumePhase) func(*kubevirtv1.VirtualMachineInstance, kubevirtv1.VolumeStatus, bool) bool {
	return func(_ *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
		return ok && e.Phase == p
	}
}

// describe renders the VMI's hotplug state and attachment pods for a
// failure message.
func describe(s *Sim, vmi *kubevirtv1.VirtualMachineInstance) string {
	if vmi == nil {
		return "no VMI"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "VMI phase %s, spec volumes:", vmi.Status.Phase)
	for _, v := range vmi.Spec.Volumes {
		fmt.Fprintf(&b, " %s", v.Name)
	}
	for _, e := range vmi.Status.VolumeStatus {
		if e.HotplugVolume != nil {
			fmt.Fprintf(&b, "\n  %s: %s %s %q target=%q pod=%s uid=%q", e.Name, e.Phase, e.Reason, e.Message, e.Target, e.HotplugVolume.AttachPodName, e.HotplugVolume.AttachPodUID)
		}
	}
	for _, p := range s.c.attachmentPods(vmi) {
		fmt.Fprintf(&b, "\n  pod %s %s deleting=%v volumes=%v", p.Name, p.Status.Phase, p.DeletionTimestamp != nil, podVolumes(p))
	}
	if err := s.vmis.lastSyncErr(vmi.Namespace + "/" + vmi.Name); err != "" {
		fmt.Fprintf(&b, "\n  virt-controller: %s", err)
	}
	return b.String()
}

// waitPasses waits until virt-handler has looked at vm1 n more times: a
// stuck entry must stay stuck while virt-handler keeps polling it.
func waitPasses(t *testing.T, s *Sim, ns string, n int) {
	t.Helper()
	waitPassesOf(t, s, ns+"/vm1", n)
}

// waitPassesOf waits until virt-handler has looked at the VM key n more
// times.
func waitPassesOf(t *testing.T, s *Sim, key string, n int) {
	t.Helper()
	want := s.handler.pass(key) + n
	testwait.Until(testCtx(t, 30*time.Second), t, fmt.Sprintf("%d virt-handler passes over %s", n, key), func() (bool, string) {
		return s.handler.pass(key) >= want, fmt.Sprintf("%d made", s.handler.pass(key)-want+n)
	})
}

// runningPodHolding returns the running, not deleting attachment pod
// holding volume, or nil.
func runningPodHolding(s *Sim, vmi *kubevirtv1.VirtualMachineInstance, volume string) *corev1.Pod {
	for _, p := range s.c.attachmentPods(vmi) {
		if p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning && slices.Contains(podVolumes(p), volume) {
			return p
		}
	}
	return nil
}

// mustAdd and mustRemove call the VM subresource and retry a lost
// compare-and-swap (422) as virtctl does: the legacy controller trims the
// request list while the previous call is processed.
func mustAdd(t *testing.T, s *Sim, ns, volume string) {
	t.Helper()
	expect202(t, retry422(func() answer { return addVolume(t, s, ns, "vm1", volume) }))
}

func mustRemove(t *testing.T, s *Sim, ns, volume string) {
	t.Helper()
	expect202(t, retry422(func() answer { return removeVolume(t, s, ns, "vm1", volume) }))
}

func retry422(call func() answer) answer {
	a := call()
	for i := 0; i < 15 && a.code == 422 && a.status.Message == "the server rejected our request due to an error in our request"; i++ {
		a = call()
	}
	return a
}

// requestsDone: the legacy controller applied and trimmed every request.
func requestsDone(t *testing.T, s *Sim, ns string, cond func(*kubevirtv1.VirtualMachine) bool) {
	t.Helper()
	if err := s.Wait(testCtx(t, 60*time.Second), ns, "vm1", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return vm != nil && len(vm.Status.VolumeRequests) == 0 && cond(vm)
	}); err != nil {
		vm, _ := s.VM(ns, "vm1")
		t.Fatalf("volume requests not done: %v %+v", err, vm.Status)
	}
}

func specLacks(name string) func(*kubevirtv1.VirtualMachine) bool {
	return func(vm *kubevirtv1.VirtualMachine) bool { return !HasVolume(vm.Spec.Template.Spec.Volumes, name) }
}

// Behaviour 1: re-adding a volume whose entry is still Detaching sticks in
// Detaching for good on v1.5.3, v1.6.3 and v1.7.0, and goes Ready on v1.8.2
// and main. KubeVirt deletes attachment pods with grace period 0, so the
// API server drops them at once: the entry is Detaching for one
// virt-controller pass (the one that deleted the pod, on its cache); the
// re-add lands in that window, held open here by pausing the controller
// right after it wrote Detaching.
func TestReaddWhileDetaching(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		s, ns, _ := scene(t, v, Options{}, "pvc-a")
		key := ns + "/vm1"
		trace := recordEntries(s, ns, "pvc-a")
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("pvc-a went through:\n%s", trace)
			}
		})
		mustAdd(t, s, ns, "pvc-a")
		ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		pauseOnDetaching := func(k string, entries []kubevirtv1.VolumeStatus) {
			if k == key && slices.ContainsFunc(entries, func(e kubevirtv1.VolumeStatus) bool {
				return e.Name == "pvc-a" && e.Phase == kubevirtv1.HotplugVolumeDetaching
			}) {
				s.vmis.pause(key, true)
			}
		}
		s.vmis.afterWrite.Store(&pauseOnDetaching)
		if v == V1_5_3 {
			// v1.5.3 writes Detaching in the very pass that sees the
			// removal, racing virt-handler's own write of the same change:
			// hold virt-handler back so that write cannot lose.
			s.handler.pause(key, true)
		}
		mustRemove(t, s, ns, "pvc-a")
		waitEntry(t, s, ns, "pvc-a", "entry Detaching", phaseIs(kubevirtv1.HotplugVolumeDetaching))
		s.handler.pause(key, false)
		requestsDone(t, s, ns, specLacks("pvc-a"))
		if v == V1_5_3 {
			// v1.5.3's virt-handler keeps the disk for its unplug time
			// (~0.5 s); a re-add sooner finds it still in the domain and
			// the entry simply stays Ready. The stuck case is the re-add
			// after the unplug.
			waitEntry(t, s, ns, "pvc-a", "entry UnMountedFromPod", phaseIs(kubevirtv1.HotplugVolumeUnMounted))
		}
		mustAdd(t, s, ns, "pvc-a") // the naive order
		waitEntry(t, s, ns, "pvc-a", "volume back in the VMI spec", func(vmi *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, _ bool) bool {
			return HasVolume(vmi.Spec.Volumes, "pvc-a")
		})
		s.vmis.afterWrite.Store(nil)
		s.vmis.pause(key, false)

		if v == V1_8_2 || v == VMain {
			ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
			return
		}
		// A new pod holds the volume, runs and is named with its UID, and
		// virt-handler has the volume mounted: a fresh entry would now go
		// MountedToPod. This one stays Detaching; on v1.5.3, where
		// virt-handler wrote Ready over Detaching while the domain still had
		// the disk and then UnMountedFromPod, it stays UnMountedFromPod,
		// which neither side moves either.
		waitEntry(t, s, ns, "pvc-a", "a running pod for the re-added volume", func(vmi *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
			p := runningPodHolding(s, vmi, "pvc-a")
			return ok && p != nil && e.HotplugVolume.AttachPodName == p.Name && e.HotplugVolume.AttachPodUID == p.UID &&
				s.handler.isMounted(vmi, "pvc-a") && len(s.c.attachmentPods(vmi)) == 1
		})
		waitPasses(t, s, ns, 5)
		_, vmi := s.VM(ns, "vm1")
		stuck := []kubevirtv1.VolumePhase{kubevirtv1.HotplugVolumeDetaching}
		if v == V1_5_3 {
			stuck = append(stuck, kubevirtv1.HotplugVolumeUnMounted)
		}
		if e, _ := FindVolumeStatus(vmi, "pvc-a"); !slices.Contains(stuck, e.Phase) || e.Target != "" {
			t.Errorf("re-added volume left Detaching on %s:\n%s", v, describe(s, vmi))
		}
	})
}

// Behaviour 1 and 5, the source's own mechanism: a pod being deleted that
// holds the whole set counts as the current pod up to v1.7.0, and as
// neither current nor old from PR 16159 on. (KubeVirt's own deletes use
// grace period 0, so only a pod something else deletes, or one a
// finalizer holds, is ever seen in that state.)
func TestTerminatingPodIsCurrent(t *testing.T) {
	deleting := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "hp-volume-old", DeletionTimestamp: ptr.To(metav1.Now()),
		Annotations: map[string]string{annotationAttachmentPodVolumes: `["x"]`}}}
	for _, v := range Versions() {
		current, old := activeAndOldPods(v.features(), []string{"x"}, []*corev1.Pod{deleting})
		wantCurrent := v == V1_5_3 || v == V1_6_3 || v == V1_7_0
		if (current != nil) != wantCurrent || len(old) != 0 {
			t.Errorf("%s: current %v, old %d; want current %v, no old pod", v, current != nil, len(old), wantCurrent)
		}
	}
}

// Behaviour 2: a volume re-added while its entry is UnMountedFromPod stays
// UnMountedFromPod while the current pod holds the set, in every version.
// The window (virt-handler's write before virt-controller's next pass) is
// held open by pausing virt-controller's VMI controller.
func TestReaddWhileUnmounted(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		s, ns, _ := scene(t, v, Options{}, "pvc-a")
		key := ns + "/vm1"
		mustAdd(t, s, ns, "pvc-a")
		ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		_, vmi := s.VM(ns, "vm1")
		pod := runningPodHolding(s, vmi, "pvc-a")
		s.vmis.pause(key, true)
		mustRemove(t, s, ns, "pvc-a")
		waitEntry(t, s, ns, "pvc-a", "entry UnMountedFromPod", phaseIs(kubevirtv1.HotplugVolumeUnMounted))
		requestsDone(t, s, ns, specLacks("pvc-a"))
		mustAdd(t, s, ns, "pvc-a")
		waitEntry(t, s, ns, "pvc-a", "volume back in the VMI spec", func(vmi *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, _ bool) bool {
			return HasVolume(vmi.Spec.Volumes, "pvc-a")
		})
		s.vmis.pause(key, false)
		waitEntry(t, s, ns, "pvc-a", "volume mounted again", func(vmi *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, _ bool) bool {
			return s.handler.isMounted(vmi, "pvc-a")
		})
		waitPasses(t, s, ns, 5)
		_, vmi = s.VM(ns, "vm1")
		e, _ := FindVolumeStatus(vmi, "pvc-a")
		if e.Phase != kubevirtv1.HotplugVolumeUnMounted || e.HotplugVolume.AttachPodName != pod.Name || runningPodHolding(s, vmi, "pvc-a") == nil {
			t.Errorf("re-added volume left UnMountedFromPod on %s:\n%s", v, describe(s, vmi))
		}
	})
}

// entryLog records every state a volume's entry takes (from the VMI watch).
type entryLog struct {
	mu      sync.Mutex
	entries []kubevirtv1.VolumeStatus
}

func recordEntries(s *Sim, ns, volume string) *entryLog {
	l := &entryLog{}
	_, _ = s.c.vmiInf.AddEventHandler(cacheHandler(func(obj any) {
		vmi, ok := obj.(*kubevirtv1.VirtualMachineInstance)
		if !ok || vmi.Namespace != ns {
			return
		}
		if e, ok := FindVolumeStatus(vmi, volume); ok {
			l.mu.Lock()
			l.entries = append(l.entries, *e.DeepCopy())
			l.mu.Unlock()
		}
	}))
	return l
}

func (l *entryLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	for _, e := range l.entries {
		fmt.Fprintf(&b, "  %s %s %q pod=%s uid=%q target=%q\n", e.Phase, e.Reason, e.Message, e.HotplugVolume.AttachPodName, e.HotplugVolume.AttachPodUID, e.Target)
	}
	return b.String()
}

// after returns the entries recorded after the first one in phase p.
func (l *entryLog) after(p kubevirtv1.VolumePhase) []kubevirtv1.VolumeStatus {
	l.mu.Lock()
	defer l.mu.Unlock()
	i := slices.IndexFunc(l.entries, func(e kubevirtv1.VolumeStatus) bool { return e.Phase == p })
	if i < 0 {
		return nil
	}
	return slices.Clone(l.entries[i:])
}

// Behaviour 3: when no attachment pod holds the whole hotplug set (here: a
// set change while the new pod is still Pending, so none may be created),
// every entry not yet Ready, MountedToPod included, falls back to its PVC
// phase with the pod UID cleared, in every version.
func TestSetChangeResetsVolumesInFlight(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		// The domain takes 5 s to attach a disk: pvc-a waits in
		// MountedToPod meanwhile.
		s, ns, _ := scene(t, v, Options{Timings: Timings{DomainAttach: 100 * time.Second}}, "pvc-a", "pvc-b", "pvc-c")
		log := recordEntries(s, ns, "pvc-a")
		mustAdd(t, s, ns, "pvc-a")
		waitEntry(t, s, ns, "pvc-a", "pvc-a MountedToPod", phaseIs(kubevirtv1.HotplugVolumeMounted))
		s.Faults().SetAttachmentPodsStuck(ns, "vm1", true)
		mustAdd(t, s, ns, "pvc-b")
		waitEntry(t, s, ns, "pvc-b", "pvc-b AttachedToNode to a pending pod", phaseIs(kubevirtv1.HotplugVolumeAttachedToNode))
		mustAdd(t, s, ns, "pvc-c")
		waitEntry(t, s, ns, "pvc-c", "pvc-c in the VMI", func(_ *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, ok bool) bool { return ok })

		reset := func() bool {
			return slices.ContainsFunc(log.after(kubevirtv1.HotplugVolumeMounted), func(e kubevirtv1.VolumeStatus) bool {
				return e.Phase == kubevirtv1.VolumeBound && e.HotplugVolume.AttachPodUID == "" &&
					e.Reason == reasonPVCNotReady && e.Message == "PVC is in phase Bound"
			})
		}
		testwait.Until(testCtx(t, 30*time.Second), t, "pvc-a to be reset from MountedToPod to Bound", func() (bool, string) {
			_, vmi := s.VM(ns, "vm1")
			return reset(), describe(s, vmi)
		})
		s.Faults().SetAttachmentPodsStuck(ns, "vm1", false)
		for _, c := range []string{"pvc-a", "pvc-b", "pvc-c"} {
			ready(t, s, ns, "vm1", c, 60*time.Second)
		}
	})
}

// Behaviour 4: an existing claim counts as ready to attach bound or not
// (only a DataVolume's claims wait): an unbound one goes into the
// attachment pod, which stays Pending, and every new volume of the VM
// stalls in AttachedToNode behind it, in every version.
func TestUnboundClaimStallsTheVM(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{}, "pvc-a", "pvc-b")
		mustAdd(t, s, ns, "pvc-a")
		ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		unbound := createClaim(ctx, t, s, ns, "pvc-unbound", "") // no provisioner serves its class
		mustAdd(t, s, ns, "pvc-unbound")
		waitEntry(t, s, ns, "pvc-unbound", "the unbound claim AttachedToNode", phaseIs(kubevirtv1.HotplugVolumeAttachedToNode))
		mustAdd(t, s, ns, "pvc-b")
		waitEntry(t, s, ns, "pvc-b", "pvc-b AttachedToNode to the pending pod", func(vmi *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
			if !ok || e.Phase != kubevirtv1.HotplugVolumeAttachedToNode {
				return false
			}
			for _, p := range s.c.attachmentPods(vmi) {
				if p.Name == e.HotplugVolume.AttachPodName {
					return p.Status.Phase == corev1.PodPending && sameSet(podVolumes(p), []string{"pvc-a", "pvc-unbound", "pvc-b"})
				}
			}
			return false
		})
		waitPasses(t, s, ns, 5)
		_, vmi := s.VM(ns, "vm1")
		b, _ := FindVolumeStatus(vmi, "pvc-b")
		a, _ := FindVolumeStatus(vmi, "pvc-a")
		if b.Phase != kubevirtv1.HotplugVolumeAttachedToNode || b.HotplugVolume.AttachPodUID != "" || a.Phase != kubevirtv1.VolumeReady || runningPodHolding(s, vmi, "pvc-a") == nil {
			t.Errorf("the VM did not stall behind the unbound claim on %s:\n%s", v, describe(s, vmi))
		}
		// Binding the claim lets the pod start and everything through.
		unbound.Status.Phase = corev1.ClaimBound
		if _, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, unbound, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		ready(t, s, ns, "vm1", "pvc-b", 30*time.Second)
		ready(t, s, ns, "vm1", "pvc-unbound", 30*time.Second)
	})
}

// createClaim creates a claim of a class nothing binds; phase, if set, is
// written to its status.
func createClaim(ctx context.Context, t *testing.T, s *Sim, ns, name string, phase corev1.PersistentVolumeClaimPhase) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc, err := s.c.kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			VolumeMode:       ptr.To(corev1.PersistentVolumeBlock),
			StorageClassName: ptr.To("unserved"),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if phase != "" {
		pvc.Status.Phase = phase
		if pvc, err = s.c.kube.CoreV1().PersistentVolumeClaims(ns).UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return pvc
}

// Behaviour 4 (missing claim) and 8 (Lost): a hotplug volume whose claim
// does not exist aborts virt-controller's hotplug handling for the whole
// VMI ("Error determining volume status didn't find PVC <claim>"): no pod
// is created or deleted, so new volumes stay in their PVC phase and a
// removed one never leaves Detaching, until the claim appears.
func TestMissingClaimAbortsHotplug(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{}, "pvc-a", "pvc-b")
		key := ns + "/vm1"
		mustAdd(t, s, ns, "pvc-a")
		ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		_, vmi := s.VM(ns, "vm1")
		oldPod := runningPodHolding(s, vmi, "pvc-a")

		mustAdd(t, s, ns, "pvc-missing")
		notFound := "PVC pvc-missing not found"
		if v == V1_5_3 {
			notFound = "Unable to determine PVC name"
		}
		waitEntry(t, s, ns, "pvc-missing", "the missing claim's entry", func(_ *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
			return ok && e.Phase == kubevirtv1.VolumePending && e.Reason == reasonPVCNotFound && e.Message == notFound
		})
		if got, want := s.vmis.lastSyncErr(key), "Error determining volume status didn't find PVC pvc-missing"; got != want {
			t.Errorf("virt-controller error %q, want %q", got, want)
		}
		createClaim(ctx, t, s, ns, "pvc-lost", corev1.ClaimLost)
		mustAdd(t, s, ns, "pvc-lost")
		mustAdd(t, s, ns, "pvc-b")
		waitEntry(t, s, ns, "pvc-lost", "the lost claim's entry", func(_ *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
			return ok && e.Phase == kubevirtv1.VolumePending && e.Reason == reasonPVCNotReady && e.Message == "PVC is in phase Lost"
		})
		waitEntry(t, s, ns, "pvc-b", "pvc-b in its PVC phase", phaseIs(kubevirtv1.VolumeBound))
		mustRemove(t, s, ns, "pvc-a")
		waitEntry(t, s, ns, "pvc-a", "pvc-a Detaching", phaseIs(kubevirtv1.HotplugVolumeDetaching))
		waitPasses(t, s, ns, 5)
		_, vmi = s.VM(ns, "vm1")
		pods := s.c.attachmentPods(vmi)
		a, _ := FindVolumeStatus(vmi, "pvc-a")
		b, _ := FindVolumeStatus(vmi, "pvc-b")
		// On 1.5.x virt-handler's pass fails at the first mount error
		// (pvc-b is looked up in pvc-a's pod, internal/virthandler), before
		// the domain lets pvc-a's disk go, and writes the status anyway: the
		// removed entry flips between Detaching and Ready there.
		aStuck := a.Phase == kubevirtv1.HotplugVolumeDetaching || v == V1_5_3 && a.Phase == kubevirtv1.VolumeReady
		if len(pods) != 1 || pods[0].UID != oldPod.UID || pods[0].DeletionTimestamp != nil || !aStuck || b.Phase != kubevirtv1.VolumeBound {
			t.Errorf("hotplug handling went on with a claim missing on %s:\n%s", v, describe(s, vmi))
		}
		// The claim appears (and the lost one goes, or its pod would never
		// start): pvc-a's old pod goes, and with it its entry.
		if _, err := s.CreatePVC(ctx, ns, "pvc-missing", "1Gi", false); err != nil {
			t.Fatal(err)
		}
		mustRemove(t, s, ns, "pvc-lost")
		waitEntry(t, s, ns, "pvc-a", "pvc-a's entry gone", func(_ *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, ok bool) bool { return !ok })
		if err := s.vmis.lastSyncErr(key); err != "" {
			t.Errorf("virt-controller still fails: %s", err)
		}
	})
}

// Behaviour 5: old attachment pods. While the current pod is not running,
// the newest running old pod stays (main: only if it still holds a volume
// in the spec or one not yet unmounted) and pending old pods are deleted;
// from v1.6 on an old pod also stays while it holds a removed volume not
// yet unmounted.
func TestOldAttachmentPods(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		s, ns, _ := scene(t, v, Options{}, "pvc-a", "pvc-b")
		mustAdd(t, s, ns, "pvc-a")
		ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		_, vmi := s.VM(ns, "vm1")
		first := runningPodHolding(s, vmi, "pvc-a")
		s.Faults().SetAttachmentPodsStuck(ns, "vm1", true)
		mustAdd(t, s, ns, "pvc-b")
		var pending *corev1.Pod
		waitEntry(t, s, ns, "pvc-b", "a pending pod for pvc-a and pvc-b", func(vmi *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, _ bool) bool {
			for _, p := range s.c.attachmentPods(vmi) {
				if p.Status.Phase == corev1.PodPending && sameSet(podVolumes(p), []string{"pvc-a", "pvc-b"}) {
					pending = p
					return true
				}
			}
			return false
		})
		// The set changes again: the pending pod goes, the running one stays.
		mustRemove(t, s, ns, "pvc-a")
		waitEntry(t, s, ns, "pvc-a", "the pending pod deleted", func(vmi *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, _ bool) bool {
			return !slices.ContainsFunc(s.c.attachmentPods(vmi), func(p *corev1.Pod) bool { return p.UID == pending.UID && p.DeletionTimestamp == nil })
		})
		waitEntry(t, s, ns, "pvc-b", "a pending pod for pvc-b alone", func(vmi *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, _ bool) bool {
			return slices.ContainsFunc(s.c.attachmentPods(vmi), func(p *corev1.Pod) bool {
				return p.Status.Phase == corev1.PodPending && p.DeletionTimestamp == nil && sameSet(podVolumes(p), []string{"pvc-b"})
			})
		})
		if v == V1_5_3 {
			// v1.5's virt-handler looks pvc-b, which has no pod UID of its
			// own yet, up in pvc-a's pod (first-UID reuse, kubevirt v1.5.2
			// pkg/virt-handler/hotplug-disk/mount.go:330) and fails the
			// whole pass on it (vm.go:3111-3113), before the domain sync and
			// Unmount: pvc-a keeps its disk and its mount while the new pod
			// is pending, and its entry flips between virt-controller's
			// Detaching and virt-handler's Ready.
			waitPasses(t, s, ns, 5)
			if _, vmi := s.VM(ns, "vm1"); !s.handler.isMounted(vmi, "pvc-a") {
				t.Errorf("pvc-a unmounted on %s behind a failing pass:\n%s", v, describe(s, vmi))
			}
		} else {
			waitEntry(t, s, ns, "pvc-a", "pvc-a unmounted", func(vmi *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
				return !s.handler.isMounted(vmi, "pvc-a")
			})
		}
		if v == VMain {
			// The old pod holds nothing worth keeping any more: it goes.
			waitEntry(t, s, ns, "pvc-a", "pvc-a's entry gone with its pod", func(_ *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, ok bool) bool { return !ok })
		} else {
			waitPasses(t, s, ns, 5)
			_, vmi = s.VM(ns, "vm1")
			if p := runningPodHolding(s, vmi, "pvc-a"); p == nil || p.UID != first.UID {
				t.Errorf("the newest running old pod was not kept on %s:\n%s", v, describe(s, vmi))
			}
			if e, ok := FindVolumeStatus(vmi, "pvc-a"); !ok || (e.Phase != kubevirtv1.HotplugVolumeDetaching && (v != V1_5_3 || e.Phase != kubevirtv1.VolumeReady)) {
				t.Errorf("pvc-a's entry %+v on %s, want Detaching while its pod is kept", e, v)
			}
		}
		s.Faults().SetAttachmentPodsStuck(ns, "vm1", false)
		ready(t, s, ns, "vm1", "pvc-b", 30*time.Second)
		detached(t, s, ns, "vm1", "pvc-a", 30*time.Second)
	})
}

// Behaviour 5, second half: from v1.6 on, a removed volume's old pod stays
// until virt-handler has unmounted the volume, even once the new pod runs;
// v1.5.3 deletes it as soon as the new pod runs.
func TestOldPodWaitsForUnmount(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		// Unmounting takes 5 s here.
		s, ns, _ := scene(t, v, Options{Timings: Timings{Detach: 100 * time.Second}}, "pvc-a", "pvc-b")
		mustAdd(t, s, ns, "pvc-a")
		ready(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		mustAdd(t, s, ns, "pvc-b")
		ready(t, s, ns, "vm1", "pvc-b", 30*time.Second)
		_, vmi := s.VM(ns, "vm1")
		both := runningPodHolding(s, vmi, "pvc-a")
		deleted := make(chan bool, 1) // whether pvc-a was still mounted then
		_, _ = s.c.podInf.AddEventHandler(onDelete(func(obj any) {
			if p, ok := obj.(*corev1.Pod); ok && p.UID == both.UID {
				deleted <- s.handler.isMounted(vmi, "pvc-a")
			}
		}))
		mustRemove(t, s, ns, "pvc-a")
		var mounted bool
		select {
		case mounted = <-deleted:
		case <-time.After(60 * time.Second):
			_, vmi := s.VM(ns, "vm1")
			t.Fatalf("the old pod was never deleted:\n%s", describe(s, vmi))
		}
		if want := v == V1_5_3; mounted != want {
			t.Errorf("old pod deleted with pvc-a mounted=%v on %s, want %v", mounted, v, want)
		}
		detached(t, s, ns, "vm1", "pvc-a", 30*time.Second)
		if _, vmi := s.VM(ns, "vm1"); s.handler.isMounted(vmi, "pvc-b") == false {
			t.Error("pvc-b lost its mount")
		}
	})
}

// Behaviour 6: a stopped VM's VMI lives on for its grace period (30 s
// scaled to 1.5 s here); from v1.6 on the domain starts only once every
// hotplug volume is MountedToPod or Ready, v1.5.3 starts it at once.
func TestVMStopAndStart(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{}, "pvc-a")
		if err := s.StopVM(ctx, ns, "vm1"); err != nil {
			t.Fatal(err)
		}
		waitVMI(t, s, ns, "vm1", func(vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi.DeletionTimestamp != nil })
		seen := time.Now()
		if err := s.Wait(ctx, ns, "vm1", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool { return vmi == nil }); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(seen); d < time.Second { // a lower bound: load only makes it longer
			t.Errorf("the VMI went %v after the stop, before its grace period", d)
		}

		// Start a VM whose template has a hotplug volume, with its
		// attachment pod stuck.
		s.Faults().SetAttachmentPodsStuck(ns, "vm2", true)
		_, err := s.CreateVM(ctx, VMSpec{
			Namespace: ns, Name: "vm2", NoWait: true,
			Volumes: []kubevirtv1.Volume{pvcVol("pvc-a", "pvc-a", true)},
			Disks:   []kubevirtv1.Disk{{Name: "pvc-a", DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: "scsi"}}}},
		})
		if err != nil {
			t.Fatal(err)
		}
		err = s.Wait(ctx, ns, "vm2", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
			e, ok := FindVolumeStatus(vmi, "pvc-a")
			return ok && e.Phase == kubevirtv1.HotplugVolumeAttachedToNode
		})
		if err != nil {
			t.Fatal(err)
		}
		want := kubevirtv1.Scheduled
		if v == V1_5_3 {
			want = kubevirtv1.Running
		}
		if err := s.Wait(ctx, ns, "vm2", func(_ *kubevirtv1.VirtualMachine, vmi *kubevirtv1.VirtualMachineInstance) bool {
			return vmi.Status.Phase == want
		}); err != nil {
			t.Fatal(err)
		}
		waitPassesOf(t, s, ns+"/vm2", 5)
		if _, vmi := s.VM(ns, "vm2"); vmi.Status.Phase != want {
			t.Errorf("VMI %s with its hotplug volume not mounted, want %s", vmi.Status.Phase, want)
		}
		s.Faults().SetAttachmentPodsStuck(ns, "vm2", false)
		if _, err := s.WaitVolumeReady(ctx, ns, "vm2", "pvc-a"); err != nil {
			t.Fatal(err)
		}
		if _, vmi := s.VM(ns, "vm2"); vmi.Status.Phase != kubevirtv1.Running {
			t.Errorf("VMI %s", vmi.Status.Phase)
		}
	})
}

// Behaviour 7: the declarative controller. The VMI update validator judges
// the controller's whole patch, so one bad disk holds back every change of
// the VM; a changed disk alone does not unplug a volume, a changed volume
// does; a patch that loses its compare-and-swap sets the Failure condition.
func TestDeclarativeController(t *testing.T) {
	t.Parallel()
	perVersion(t, declarativeVersions(), func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{Mode: ModeDeclarative}, "pvc-ok", "pvc-sata", "pvc-x", "pvc-other")
		c := proxyKV(t, s)
		edit := func(f func(spec *kubevirtv1.VirtualMachineInstanceSpec)) {
			t.Helper()
			err := retry.RetryOnConflict(retry.DefaultRetry, func() error { // the VM controller writes the status
				vm := &kubevirtv1.VirtualMachine{}
				if err := c.get(ctx, resVMs, ns, "vm1", vm); err != nil {
					return err
				}
				f(&vm.Spec.Template.Spec)
				return c.update(ctx, resVMs, ns, "vm1", "", vm, vm)
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		condition := func(msg string) {
			t.Helper()
			err := s.Wait(ctx, ns, "vm1", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
				return slices.ContainsFunc(vm.Status.Conditions, func(c kubevirtv1.VirtualMachineCondition) bool {
					return c.Type == kubevirtv1.VirtualMachineFailure && c.Reason == ReasonHotPlugVolumeError && c.Message == msg
				}) || (msg == "" && len(vm.Status.Conditions) == 0)
			})
			if err != nil {
				vm, _ := s.VM(ns, "vm1")
				t.Fatalf("condition %q: %v %+v", msg, err, vm.Status.Conditions)
			}
		}

		// One patch with a good and a bad disk: neither reaches the VMI.
		edit(func(spec *kubevirtv1.VirtualMachineInstanceSpec) {
			applyVolumeRequest(spec, addReq("pvc-ok"))
			applyVolumeRequest(spec, &kubevirtv1.VirtualMachineVolumeRequest{AddVolumeOptions: addOpts("pvc-sata", "pvc-sata", "sata")})
		})
		condition(`Error encountered while handling declarative hotplug volumes: admission webhook "virtualmachineinstances-update-validator.kubevirt.io" denied the request: Hotplug configuration for disk [pvc-sata] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted.`)
		if _, vmi := s.VM(ns, "vm1"); HasVolume(vmi.Spec.Volumes, "pvc-ok") {
			t.Error("the good volume of a rejected patch reached the VMI")
		}
		edit(func(spec *kubevirtv1.VirtualMachineInstanceSpec) { applyVolumeRequest(spec, rmReq("pvc-sata")) })
		ready(t, s, ns, "vm1", "pvc-ok", 30*time.Second)
		condition("")

		// A changed disk alone leaves the VMI alone.
		edit(func(spec *kubevirtv1.VirtualMachineInstanceSpec) {
			for i := range spec.Domain.Devices.Disks {
				if spec.Domain.Devices.Disks[i].Name == "pvc-ok" {
					spec.Domain.Devices.Disks[i].Disk.Bus = kubevirtv1.DiskBusVirtio
				}
			}
		})
		observed(t, s, ns)
		if _, vmi := s.VM(ns, "vm1"); diskBusOf(vmi, "pvc-ok") != kubevirtv1.DiskBusSCSI {
			t.Error("a disk change alone reached the VMI")
		}
		if e, _ := FindVolumeStatus(func() *kubevirtv1.VirtualMachineInstance { _, vmi := s.VM(ns, "vm1"); return vmi }(), "pvc-ok"); e.Phase != kubevirtv1.VolumeReady {
			t.Errorf("pvc-ok %s after a disk change", e.Phase)
		}
		// A changed volume is unplugged and plugged again, with the new disk.
		log := recordPhases(s, ns, "vm1")
		edit(func(spec *kubevirtv1.VirtualMachineInstanceSpec) {
			for i := range spec.Volumes {
				if spec.Volumes[i].Name == "pvc-ok" {
					spec.Volumes[i].PersistentVolumeClaim.ReadOnly = true
				}
			}
		})
		waitEntry(t, s, ns, "pvc-ok", "pvc-ok back with the new disk", func(vmi *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
			return ok && e.Phase == kubevirtv1.VolumeReady && strings.HasPrefix(e.Target, "vd") && diskBusOf(vmi, "pvc-ok") == kubevirtv1.DiskBusVirtio
		})
		if got := log.get("pvc-ok"); !slices.Contains(got, "-") {
			t.Errorf("pvc-ok was not unplugged first: %v", got)
		}

		// The VMI moves on between the controller's read and its patch.
		var once sync.Once
		hook := func(vmi *kubevirtv1.VirtualMachineInstance) {
			once.Do(func() {
				spec := vmi.Spec.DeepCopy()
				applyVolumeRequest(spec, addReq("pvc-other"))
				patch, _ := casPatch(
					casOp{"/spec/volumes", vmi.Spec.Volumes, spec.Volumes, true},
					casOp{"/spec/domain/devices/disks", vmi.Spec.Domain.Devices.Disks, spec.Domain.Devices.Disks, true},
				)
				if err := s.c.kv.patch(ctx, resVMIs, ns, "vm1", "", types.JSONPatchType, patch, nil, &kubevirtv1.VirtualMachineInstance{}); err != nil {
					t.Errorf("moving the VMI on: %v", err)
				}
			})
		}
		s.vms.beforeDeclarativePatch.Store(&hook)
		edit(func(spec *kubevirtv1.VirtualMachineInstanceSpec) { applyVolumeRequest(spec, addReq("pvc-x")) })
		condition("Error encountered while handling declarative hotplug volumes: the server rejected our request due to an error in our request")
		ready(t, s, ns, "vm1", "pvc-x", 30*time.Second)
		condition("")
		waitEntry(t, s, ns, "pvc-other", "the VMI-only volume removed", func(vmi *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, ok bool) bool {
			return !ok && !HasVolume(vmi.Spec.Volumes, "pvc-other")
		})
	})
}

// observed waits until the VM controller has seen the VM's latest spec.
func observed(t *testing.T, s *Sim, ns string) {
	t.Helper()
	vm, _ := s.VM(ns, "vm1")
	gen := vm.Generation
	err := s.Wait(testCtx(t, 30*time.Second), ns, "vm1", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
		return vm.Status.ObservedGeneration >= gen && vm.Generation >= gen
	})
	if err != nil {
		t.Fatal(err)
	}
}

func diskBusOf(vmi *kubevirtv1.VirtualMachineInstance, name string) kubevirtv1.DiskBus {
	d, ok := diskNamed(vmi.Spec.Domain.Devices.Disks, name)
	if !ok {
		return ""
	}
	return diskBus(&d)
}

// Behaviour 7 (the validator itself) per version: a new hotplug disk on an
// unsupported bus is refused with the version's message.
func TestVMIUpdateValidator(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{}, "pvc-a")
		_, vmi := s.VM(ns, "vm1")
		spec := vmi.Spec.DeepCopy()
		applyVolumeRequest(spec, &kubevirtv1.VirtualMachineVolumeRequest{AddVolumeOptions: addOpts("pvc-a", "pvc-a", "sata")})
		patch, _ := casPatch(
			casOp{"/spec/volumes", vmi.Spec.Volumes, spec.Volumes, true},
			casOp{"/spec/domain/devices/disks", vmi.Spec.Domain.Devices.Disks, spec.Domain.Devices.Disks, true},
		)
		err := s.c.kv.patch(ctx, resVMIs, ns, "vm1", "", types.JSONPatchType, patch, nil, &kubevirtv1.VirtualMachineInstance{})
		msg := "Hotplug configuration for disk [pvc-a] requires bus to be 'scsi' or 'virtio'. [sata] is not permitted."
		if v == V1_5_3 {
			msg = "hotplugged Disk pvc-a does not use a scsi bus"
		}
		if want := `admission webhook "virtualmachineinstances-update-validator.kubevirt.io" denied the request: ` + msg; !apierrors.IsInvalid(err) || err.Error() != want {
			t.Errorf("got %v\nwant %s", err, want)
		}
	})
}

// Behaviour 8: the legacy controller's failed spec update reads the same in
// every version.
func TestSpecUpdateFailureMessage(t *testing.T) {
	t.Parallel()
	perVersion(t, Versions(), func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{}, "pvc-a")
		s.Faults().DenyVolume("pvc-a", "the volume pvc-a is already used by VM other/vm9")
		mustAdd(t, s, ns, "pvc-a")
		want := `Error encountered when trying to update vm according to add volume and/or memory dump requests: admission webhook "validator.harvesterhci.io" denied the request: the volume pvc-a is already used by VM other/vm9`
		err := s.Wait(ctx, ns, "vm1", func(vm *kubevirtv1.VirtualMachine, _ *kubevirtv1.VirtualMachineInstance) bool {
			return slices.ContainsFunc(vm.Status.Conditions, func(c kubevirtv1.VirtualMachineCondition) bool {
				return c.Type == kubevirtv1.VirtualMachineFailure && c.Reason == ReasonFailedUpdateError && c.Message == want
			})
		})
		if err != nil {
			vm, _ := s.VM(ns, "vm1")
			t.Fatalf("%v %+v", err, vm.Status.Conditions)
		}
	})
}
