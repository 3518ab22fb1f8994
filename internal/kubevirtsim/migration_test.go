package kubevirtsim

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// migrationPhases records every phase each migration of the namespace
// takes, from the watch.
type migrationPhases struct {
	mu     sync.Mutex
	phases map[string][]string
}

func recordMigrations(s *Sim) *migrationPhases {
	l := &migrationPhases{phases: map[string][]string{}}
	_, _ = s.c.migInf.AddEventHandler(cacheHandler(func(obj any) {
		m, ok := obj.(*kubevirtv1.VirtualMachineInstanceMigration)
		if !ok {
			return
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		ps := l.phases[m.Name]
		if p := string(m.Status.Phase); len(ps) == 0 || ps[len(ps)-1] != p {
			l.phases[m.Name] = append(ps, p)
		}
	}))
	return l
}

func (l *migrationPhases) get(name string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.phases[name])
}

func waitMigration(t *testing.T, s *Sim, ns, name string, phase kubevirtv1.VirtualMachineInstanceMigrationPhase) {
	t.Helper()
	testwait.Until(testCtx(t, 60*time.Second), t, fmt.Sprintf("migration %s %s", name, phase), func() (bool, string) {
		m, ok := s.Migration(ns, name)
		if !ok {
			return false, "not in the cache"
		}
		return m.Status.Phase == phase, string(m.Status.Phase)
	})
}

// attachmentPodsOn lists the VM's attachment pods on a host node (any
// owner, not deleting).
func attachmentPodsOn(s *Sim, ns, vm, node string) []*corev1.Pod {
	all, _ := s.c.podLister.Pods(ns).List(labels.SelectorFromSet(labels.Set{labelAttachmentPodVMI: vm}))
	return slices.DeleteFunc(all, func(p *corev1.Pod) bool { return p.Spec.NodeName != node || p.DeletionTimestamp != nil })
}

// handlerIdle pokes virt-handler n times over the VM, each pass apart, and
// waits for every pass: proof that it looked while nothing changed.
func handlerIdle(t *testing.T, s *Sim, ns string, n int) {
	t.Helper()
	key := ns + "/vm1"
	want := s.handler.pass(key) + n
	testwait.UntilEvery(testCtx(t, 30*time.Second), t, 20*time.Millisecond, fmt.Sprintf("%d virt-handler passes", n), func() (bool, string) {
		if s.handler.pass(key) >= want {
			return true, ""
		}
		s.handler.queue.Add(key)
		return false, fmt.Sprintf("%d to go", want-s.handler.pass(key))
	})
}

// TestMigrationMovesHotplugVolumes: a VirtualMachineInstanceMigration
// walks KubeVirt's phases, the target attachment pod is created on the
// target node before the hand-off and named in migrationState, the VMI
// ends on the target node, and its hotplug volumes stay Ready throughout,
// served by the target's pod, with nothing left on the source node.
func TestMigrationMovesHotplugVolumes(t *testing.T) {
	t.Parallel()
	perVersion(t, []Version{V1_5_3, V1_6_3, V1_7_0, V1_8_2}, func(t *testing.T, v Version) {
		s, ns, ctx := scene(t, v, Options{}, "pvc-a", "pvc-b")
		mustAdd(t, s, ns, "pvc-a")
		mustAdd(t, s, ns, "pvc-b")
		ready(t, s, ns, "vm1", "pvc-a", 60*time.Second)
		ready(t, s, ns, "vm1", "pvc-b", 60*time.Second)
		entries := recordPhases(s, ns, "vm1")
		migs := recordMigrations(s)
		_, before := s.VM(ns, "vm1")
		source, _ := FindVolumeStatus(before, "pvc-a")

		s.Faults().HoldMigration(ns, "vm1", true)
		name, err := s.Migrate(ctx, ns, "vm1", "")
		if err != nil {
			t.Fatal(err)
		}
		waitVMI(t, s, ns, "vm1", IsMigrating)
		// Until the hand-off the source's virt-launcher pod is the current
		// one: its attachment pod serves the entries and stays, while the
		// target's runs beside it on the target node.
		_, during := s.VM(ns, "vm1")
		target := attachmentPodsOn(s, ns, "vm1", "harvester-node-1")
		if len(target) != 1 || target[0].UID != during.Status.MigrationState.TargetAttachmentPodUID || !containerReady(target[0]) {
			t.Fatalf("target attachment pods %v, migrationState %+v", target, during.Status.MigrationState)
		}
		handlerIdle(t, s, ns, 3)
		_, during = s.VM(ns, "vm1")
		for _, vol := range []string{"pvc-a", "pvc-b"} {
			if e, _ := FindVolumeStatus(during, vol); e.HotplugVolume.AttachPodUID != source.HotplugVolume.AttachPodUID {
				t.Errorf("%s served by pod %s during the migration, want the source's %s", vol, e.HotplugVolume.AttachPodUID, source.HotplugVolume.AttachPodUID)
			}
		}
		if len(attachmentPodsOn(s, ns, "vm1", "harvester-node-0")) != 1 {
			t.Errorf("source attachment pods during the migration: %v", attachmentPodsOn(s, ns, "vm1", "harvester-node-0"))
		}
		s.Faults().HoldMigration(ns, "vm1", false)
		waitMigration(t, s, ns, name, kubevirtv1.MigrationSucceeded)
		// The informer updates its cache before it calls the recorder.
		testwait.Until(ctx, t, "the recorder sees the migration succeed", func() (bool, string) {
			got := migs.get(name)
			return len(got) > 0 && got[len(got)-1] == string(kubevirtv1.MigrationSucceeded), fmt.Sprint(got)
		})
		want := []string{"", "Pending", "Scheduling", "Scheduled", "PreparingTarget", "TargetReady", "Running", "Succeeded"}
		if got := migs.get(name); !slices.Equal(got, want) && !slices.Equal(got, want[1:]) {
			t.Errorf("migration phases %v, want %v", got, want)
		}
		_, vmi := s.VM(ns, "vm1")
		ms := vmi.Status.MigrationState
		if vmi.Status.NodeName != "harvester-node-1" || ms == nil || ms.SourceNode != "harvester-node-0" || ms.TargetNode != "harvester-node-1" ||
			!ms.Completed || ms.Failed || ms.StartTimestamp == nil || ms.EndTimestamp == nil || ms.TargetAttachmentPodUID == "" {
			t.Fatalf("VMI after the migration: node %q, migrationState %+v", vmi.Status.NodeName, ms)
		}
		if IsMigrating(vmi) {
			t.Error("VMI still counted as migrating")
		}
		waitEntry(t, s, ns, "pvc-b", "entries served by the target attachment pod", func(vmi *kubevirtv1.VirtualMachineInstance, _ kubevirtv1.VolumeStatus, _ bool) bool {
			for _, vol := range []string{"pvc-a", "pvc-b"} {
				e, ok := FindVolumeStatus(vmi, vol)
				if !ok || e.Phase != kubevirtv1.VolumeReady || e.HotplugVolume.AttachPodUID != ms.TargetAttachmentPodUID {
					return false
				}
			}
			return true
		})
		testwait.For(t, "no attachment pod left on the source node", 30*time.Second, func() bool {
			return len(attachmentPodsOn(s, ns, "vm1", "harvester-node-0")) == 0
		})
		for _, vol := range []string{"pvc-a", "pvc-b"} {
			if got := entries.get(vol); !slices.Equal(got, []string{"Ready"}) {
				t.Errorf("%s phases during the migration %v, want Ready throughout", vol, got)
			}
		}
	})
}

// TestMigrationRefusesLegacyHotplug: while the VMI migrates, virt-api's
// addvolume on the VM is denied by the status validator with KubeVirt's
// message and queues nothing; after it, the same call works and the volume
// is attached on the target node.
func TestMigrationRefusesLegacyHotplug(t *testing.T) {
	t.Parallel()
	s, ns, ctx := scene(t, V1_6_3, Options{Mode: ModeLegacy}, "pvc-a", "pvc-b")
	mustAdd(t, s, ns, "pvc-a")
	ready(t, s, ns, "vm1", "pvc-a", 60*time.Second)
	s.Faults().HoldMigration(ns, "vm1", true)
	name, err := s.Migrate(ctx, ns, "vm1", "harvester-node-2")
	if err != nil {
		t.Fatal(err)
	}
	waitVMI(t, s, ns, "vm1", IsMigrating)

	expectAnswer(t, addVolume(t, s, ns, "vm1", "pvc-b"), 422, statusHook+"Cannot handle volume requests while VMI migration is in progress")
	expectAnswer(t, removeVolume(t, s, ns, "vm1", "pvc-a"), 422, statusHook+"Cannot handle volume requests while VMI migration is in progress")
	if vm, _ := s.VM(ns, "vm1"); len(vm.Status.VolumeRequests) != 0 {
		t.Errorf("a refused request was queued: %+v", vm.Status.VolumeRequests)
	}

	s.Faults().HoldMigration(ns, "vm1", false)
	waitMigration(t, s, ns, name, kubevirtv1.MigrationSucceeded)
	mustAdd(t, s, ns, "pvc-b")
	ready(t, s, ns, "vm1", "pvc-b", 60*time.Second)
	_, vmi := s.VM(ns, "vm1")
	e, _ := FindVolumeStatus(vmi, "pvc-b")
	if p := runningPodHolding(s, vmi, "pvc-b"); p == nil || p.Spec.NodeName != "harvester-node-2" || p.UID != e.HotplugVolume.AttachPodUID {
		t.Errorf("pvc-b not served from the target node: entry %+v, pod %v", e, p)
	}
	if ready(t, s, ns, "vm1", "pvc-a", 10*time.Second) == "" {
		t.Error("pvc-a lost its target")
	}
}

// TestMigrationDoesNotGuardDeclarativeHotplug: the declarative path writes
// the VM spec during a migration unchallenged (KubeVirt 1.7 has no guard
// there) and the VM controller patches the VMI, but virt-handler leaves a
// migrating VMI alone: the added volume is not mounted and the removed one
// stays until the VMI runs on the target, where both changes complete.
func TestMigrationDoesNotGuardDeclarativeHotplug(t *testing.T) {
	t.Parallel()
	s, ns, ctx := scene(t, V1_7_0, Options{Mode: ModeDeclarative}, "pvc-a", "pvc-b")
	c := proxyKV(t, s)
	if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", []string{"pvc-a"}, nil); err != nil {
		t.Fatal(err)
	}
	ready(t, s, ns, "vm1", "pvc-a", 60*time.Second)
	s.Faults().HoldMigration(ns, "vm1", true)
	name, err := s.Migrate(ctx, ns, "vm1", "")
	if err != nil {
		t.Fatal(err)
	}
	waitVMI(t, s, ns, "vm1", IsMigrating)

	if err := patchVMVolumes(ctx, t, s, c, ns, "vm1", []string{"pvc-b"}, []string{"pvc-a"}); err != nil {
		t.Fatalf("declarative change during the migration: %v", err)
	}
	// virt-controller follows: the VMI spec changes and the source gets an
	// attachment pod for the new set, which runs.
	waitEntry(t, s, ns, "pvc-b", "pvc-b given a running source attachment pod", func(vmi *kubevirtv1.VirtualMachineInstance, e kubevirtv1.VolumeStatus, ok bool) bool {
		return ok && e.HotplugVolume != nil && e.HotplugVolume.AttachPodUID != "" && slices.ContainsFunc(vmi.Spec.Volumes, func(v kubevirtv1.Volume) bool { return v.Name == "pvc-b" })
	})
	handlerIdle(t, s, ns, 10)
	_, vmi := s.VM(ns, "vm1")
	if e, _ := FindVolumeStatus(vmi, "pvc-b"); e.Phase == kubevirtv1.HotplugVolumeMounted || e.Phase == kubevirtv1.VolumeReady {
		t.Errorf("pvc-b handled by virt-handler during the migration: %+v", e)
	}
	if !s.handler.isMounted(vmi, "pvc-a") {
		t.Error("pvc-a unmounted during the migration")
	}
	// The target's attachment pod is the migration's, with the set of its
	// creation: the VMI controller, working on the source, leaves it be.
	if target := attachmentPodsOn(s, ns, "vm1", "harvester-node-1"); len(target) != 1 || target[0].UID != vmi.Status.MigrationState.TargetAttachmentPodUID ||
		!slices.Equal(podVolumes(target[0]), []string{"pvc-a"}) {
		t.Errorf("target attachment pods during the migration %v, want the migration's holding pvc-a", target)
	}

	s.Faults().HoldMigration(ns, "vm1", false)
	waitMigration(t, s, ns, name, kubevirtv1.MigrationSucceeded)
	ready(t, s, ns, "vm1", "pvc-b", 60*time.Second)
	detached(t, s, ns, "vm1", "pvc-a", 60*time.Second)
	_, vmi = s.VM(ns, "vm1")
	if p := runningPodHolding(s, vmi, "pvc-b"); p == nil || p.Spec.NodeName != "harvester-node-1" {
		t.Errorf("pvc-b not served from the target node: %v", p)
	}
	testwait.For(t, "no attachment pod left on the source node", 30*time.Second, func() bool {
		return len(attachmentPodsOn(s, ns, "vm1", "harvester-node-0")) == 0
	})
}

// TestMigrationOfABusyVMIFails: a second migration while one runs fails, as
// KubeVirt's controller refuses it, and the first goes on.
func TestMigrationOfABusyVMIFails(t *testing.T) {
	t.Parallel()
	s, ns, ctx := scene(t, V1_7_0, Options{}, "pvc-a")
	mustAdd(t, s, ns, "pvc-a")
	ready(t, s, ns, "vm1", "pvc-a", 60*time.Second)
	s.Faults().HoldMigration(ns, "vm1", true)
	first, err := s.Migrate(ctx, ns, "vm1", "")
	if err != nil {
		t.Fatal(err)
	}
	waitVMI(t, s, ns, "vm1", IsMigrating)
	second, err := s.Migrate(context.Background(), ns, "vm1", "")
	if err != nil {
		t.Fatal(err)
	}
	waitMigration(t, s, ns, second, kubevirtv1.MigrationFailed)
	s.Faults().HoldMigration(ns, "vm1", false)
	waitMigration(t, s, ns, first, kubevirtv1.MigrationSucceeded)
}

func TestNextHostNode(t *testing.T) {
	for _, tc := range []struct{ first, source, want string }{
		{"harvester-node-0", "harvester-node-0", "harvester-node-1"},
		{"harvester-node-0", "harvester-node-2", "harvester-node-0"},
		{"harvester-node-0", "elsewhere", "harvester-node-0"},
	} {
		if got := nextHostNode(tc.first, tc.source); got != tc.want {
			t.Errorf("nextHostNode(%q, %q) = %q, want %q", tc.first, tc.source, got, tc.want)
		}
	}
}
