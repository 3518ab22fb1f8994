package kubevirt

import (
	"errors"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

func TestClassifyKubeVirtAnswers(t *testing.T) {
	vmGR := schema.GroupResource{Group: "kubevirt.io", Resource: "virtualmachine"}
	conflict := func(msg string) error { return apierrors.NewConflict(vmGR, "node-1", errors.New(msg)) }
	cases := []struct {
		name string
		err  error
		op   hotplug.Op
		want hotplug.Result
	}{
		{"accepted", nil, hotplug.Attach, hotplug.Applied},
		{"add of a volume already in the spec", conflict("Unable to add volume [pvc-1] because volume with that name already exists"), hotplug.Attach, hotplug.AlreadyDone},
		{"remove of a volume not in the spec", conflict("Unable to remove volume [pvc-1] because it does not exist"), hotplug.Detach, hotplug.AlreadyDone},
		{"queued add", conflict("add volume request for volume [pvc-1] already exists"), hotplug.Attach, hotplug.InFlight},
		{"add behind a queued remove", conflict("unable to add volume since a remove volume request for volume [pvc-1] already exists and is still being processed"), hotplug.Attach, hotplug.InFlight},
		{"queued remove", conflict("a remove volume request for volume [pvc-1] already exists and is still being processed"), hotplug.Detach, hotplug.InFlight},
		{"status webhook duplicate add", errors.New(`admission webhook "kubevirt-crd-status-validator.kubevirt.io" denied the request: AddVolume request for [pvc-1] aleady exists`), hotplug.Attach, hotplug.InFlight},
		{"JSON patch test failed", apierrors.NewGenericServerResponse(422, "", schema.GroupResource{}, "", "testing value /status/volumeRequests failed", 0, false), hotplug.Attach, hotplug.Conflict},
		{"resourceVersion conflict", apierrors.NewConflict(vmGR, "node-1", errors.New("the object has been modified")), hotplug.Attach, hotplug.Conflict},
		{"not hotpluggable", conflict("Unable to remove volume [pvc-1] because it is not hotpluggable"), hotplug.Detach, hotplug.Rejected},
		{"claim attached under another name", conflict("Unable to add volume source [pvc-1] because it already exists"), hotplug.Attach, hotplug.Rejected},
		{"third-party webhook", errors.New(`admission webhook "policy.example.com" denied the request: volume pvc-1 is refused by policy`), hotplug.Attach, hotplug.Rejected},
		// Harvester's VM validator while its cache still shows the claim on
		// another VM: transient, and it refuses detaches too.
		{"harvester 1.6 claim on another VM", harvesterDenial(`the volume pvc-1 is already used by VM guests/other`), hotplug.Attach, hotplug.Failed},
		{"harvester 1.7 claim on another VM", harvesterDenial(`PVC guests/pvc-1 is already used by other VM, please use a shareable RWX volume.`), hotplug.Attach, hotplug.Failed},
		{"harvester refusing a detach for another claim", harvesterDenial(`PVC guests/pvc-2 is already used by other VM, please use a shareable RWX volume.`), hotplug.Detach, hotplug.Failed},
		{"harvester webhook away", apierrors.NewInternalError(errors.New(`failed calling webhook "validator.harvesterhci.io": failed to call webhook: Post "https://harvester-webhook.harvester-system.svc:443/v1/webhook/validation?timeout=10s": dial tcp 10.53.0.1:443: connect: connection refused`)), hotplug.Attach, hotplug.Failed},
		{"snapshot in progress", errors.New(`admission webhook "virtualmachine-validator.kubevirt.io" denied the request: Cannot update vm disks or volumes until snapshot "s1" completes`), hotplug.Attach, hotplug.Failed},
		{"migration in progress", errors.New(`admission webhook "kubevirt-crd-status-validator.kubevirt.io" denied the request: Cannot handle volume requests while VMI migration is in progress`), hotplug.Attach, hotplug.Failed},
		{"VMI not running", apierrors.NewConflict(schema.GroupResource{Group: "kubevirt.io", Resource: "virtualmachineinstance"}, "node-1", errors.New("VMI is not running")), hotplug.Attach, hotplug.Failed},
		{"VM gone", apierrors.NewNotFound(vmGR, "node-1"), hotplug.Attach, hotplug.VMGone},
		{"feature gate off", apierrors.NewBadRequest("Enable DeclarativeHotplugVolumes or HotplugVolumes feature gate to use this API."), hotplug.Attach, hotplug.Failed},
		{"server error", apierrors.NewInternalError(errors.New("unable to patch vm status: boom")), hotplug.Attach, hotplug.Failed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := classify(tc.err, tc.op)
			if got.Result != tc.want {
				t.Errorf("classify(%v) = %s, want %s", tc.err, got.Result, tc.want)
			}
			if tc.err != nil && got.Err == nil {
				t.Error("the original error was dropped")
			}
		})
	}
}

// harvesterDenial is the API server's answer when Harvester's validator
// refuses a VM write (422 Invalid, its message behind the webhook's name).
func harvesterDenial(msg string) error {
	return &apierrors.StatusError{ErrStatus: metav1.Status{Status: metav1.StatusFailure, Code: 422, Reason: metav1.StatusReasonInvalid,
		Message: `admission webhook "validator.harvesterhci.io" denied the request: ` + msg}}
}

func TestAtLeast(t *testing.T) {
	for v, want := range map[string]bool{"v1.8.0": true, "v1.7.1": false, "v1.10.0": true, "v2.0.0": true, "v1.8.0-rc2": true, "": false, "master-head": false, "v1": false} {
		if got := atLeast(v, 1, 8); got != want {
			t.Errorf("atLeast(%q, 1.8) = %v, want %v", v, got, want)
		}
	}
}

// The API server's refusal of a VM over KubeVirt's disk limit (the CRD
// schema's maxItems) is this volume's refusal, and says the VM is full.
func TestClassifyTooManyDisks(t *testing.T) {
	for _, path := range []*field.Path{
		field.NewPath("spec", "template", "spec", "volumes"),
		field.NewPath("spec", "template", "spec", "domain", "devices", "disks"),
	} {
		err := apierrors.NewInvalid(schema.GroupKind{Group: "kubevirt.io", Kind: "VirtualMachine"}, "vm1",
			field.ErrorList{field.TooMany(path, 257, hotplug.MaxVMDisks)})
		got := classify(err, hotplug.Attach)
		if got.Result != hotplug.Rejected || !errors.Is(got.Err, hotplug.ErrVMFull) || !apierrors.IsInvalid(got.Err) {
			t.Errorf("%v: classified %+v, want Rejected wrapping ErrVMFull and the API error", err, got)
		}
	}
}
