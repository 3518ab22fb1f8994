package integration

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// migrationMidChurn: a VM live-migrates to another host node (what a
// Harvester upgrade does to every VM in turn) while volumes attach to it and
// detach from it. On the legacy gate KubeVirt refuses every volume request
// until the migration ends: the callers are told so, retryably, and no
// volume fails or is lost. On the declarative gate the changes land in the
// VM spec unguarded and KubeVirt carries them out on the target node.
// Either way every call ends OK, and the VM ends on the target node with
// exactly the volumes asked for.
func (s *suite) migrationMidChurn(t *testing.T) {
	s.simOnly(t, "live migration (its node agents have no source/target hand-off)")
	vm := "mg-vm"
	vols := s.scene(t, "mg", 5, vm)
	stay, leave, join := vols[:1], vols[1:3], vols[3:]
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a := newAttacher(s.client)
	for _, vol := range append(slices.Clone(stay), leave...) {
		if err := a.publish(ctx, vm, vol); err != nil {
			t.Fatalf("publish %s before the migration: %v", vol, err)
		}
	}
	ns, sim := s.host.Namespace, s.host.Sim
	sim.Faults().HoldMigration(ns, vm, true)
	released := false
	defer func() {
		if !released {
			sim.Faults().HoldMigration(ns, vm, false)
		}
	}()
	name, err := sim.Migrate(ctx, ns, vm, "")
	if err != nil {
		t.Fatal(err)
	}
	from := s.vmi(ctx, t, vm).Status.NodeName
	testwait.Until(ctx, t, "the VMI migrating", func() (bool, string) {
		vmi := s.vmi(ctx, t, vm)
		return kubevirtsim.IsMigrating(vmi), fmt.Sprintf("migrationState %+v", vmi.Status.MigrationState)
	})

	churn := append(slices.Clone(leave), join...)
	errs := make([]error, len(churn))
	done := make(chan struct{})
	go func() {
		defer close(done)
		eachAtOnce(churn, func(i int, vol string) {
			if i < len(leave) {
				errs[i] = a.unpublish(ctx, vm, vol)
			} else {
				errs[i] = a.publish(ctx, vm, vol)
			}
		})
	}()
	// Hold the migration until KubeVirt has had the changes: refused
	// (legacy) or written to the VM spec (declarative).
	testwait.Until(ctx, t, "the changes to meet the migration", func() (bool, string) {
		if s.f.mode == kubevirtsim.ModeLegacy {
			answers := a.Errors()
			return slices.ContainsFunc(answers, func(m string) bool { return strings.Contains(m, "migration is in progress") }),
				fmt.Sprintf("answers so far %v", answers)
		}
		// One removal is enough: OneRemovalAtATime holds the second until
		// the first's entry is gone, which waits for the migration's end.
		on := s.attachedTo(join[len(join)-1], vm)
		left := slices.ContainsFunc(leave, func(v string) bool { return !slices.Contains(s.attachedTo(v, vm), vm) })
		return slices.Contains(on, vm) && left, fmt.Sprintf("join on %v, a leave written: %v", on, left)
	})
	if s.f.mode == kubevirtsim.ModeLegacy {
		for _, m := range a.Errors() {
			if strings.Contains(m, "migration is in progress") && !strings.Contains(m, "code = "+codes.Unavailable.String()) {
				t.Errorf("a migration refusal answered %q, want Unavailable (retried)", m)
			}
		}
	}
	sim.Faults().HoldMigration(ns, vm, false)
	released = true
	<-done
	for i, err := range errs {
		if err != nil {
			t.Errorf("%s during the migration: %v", churn[i], err)
		}
	}
	if l := a.leaked(); len(l) > 0 {
		t.Errorf("KubeVirt's duplicate-request errors reached the caller: %v", l)
	}

	mig, ok := sim.Migration(ns, name)
	if !ok || mig.Status.Phase != kubevirtv1.MigrationSucceeded {
		t.Fatalf("migration %s not succeeded: %+v", name, mig)
	}
	vmi := s.vmi(ctx, t, vm)
	if vmi.Status.NodeName == from {
		t.Errorf("the VMI is still on %s", from)
	}
	for _, vol := range append(slices.Clone(stay), join...) {
		s.requireReady(vm, vol)
	}
	for _, vol := range leave {
		if on := s.attachedTo(vol, vm); len(on) != 0 {
			t.Errorf("%s still on %v after its unpublish answered OK", vol, on)
		}
	}
	unpublishAll(ctx, t, a, vm, append(slices.Clone(stay), join...))
}

// vmi reads the VM's VMI live.
func (s *suite) vmi(ctx context.Context, t *testing.T, vm string) *kubevirtv1.VirtualMachineInstance {
	t.Helper()
	vmi, err := s.kv.KubevirtV1().VirtualMachineInstances(s.host.Namespace).Get(ctx, vm, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("read VMI %s: %v", vm, err)
	}
	return vmi
}
