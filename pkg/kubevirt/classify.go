package kubevirt

import (
	"fmt"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

// classify turns KubeVirt's answer to one volume change into a hotplug
// Result. KubeVirt reports most outcomes only in message text, so the
// matching is on its exact phrases: the addvolume/removevolume handlers'
// (kubevirt v1.7.0 pkg/virt-api/rest/volumes.go, e.g. "Unable to add volume
// [%s] because volume with that name already exists") and the VM status
// webhook's (kubevirt v1.7.0
// pkg/virt-api/webhooks/validating-webhook/admitters/vms-admitter.go,
// "AddVolume request for [%s] aleady exists").
func classify(err error, op hotplug.Op) hotplug.Outcome {
	if err == nil {
		return hotplug.Outcome{Result: hotplug.Applied}
	}
	msg := err.Error()
	has := func(s string) bool { return strings.Contains(msg, s) }
	var r hotplug.Result
	switch {
	// The change is already in the spec: our own earlier write, or a retry.
	case op == hotplug.Attach && has("because volume with that name already exists"),
		op == hotplug.Detach && has("because it does not exist"):
		r = hotplug.AlreadyDone
	// A request for the volume is queued in status.volumeRequests (or the
	// status webhook saw one): wait for virt-controller to work it off.
	case has("still being processed"),
		has("volume request for volume") && has("already exists"),
		has("request for [") && has("aleady exists"), // sic: KubeVirt's typo
		has("conflicts with an existing volume of the same name"):
		r = hotplug.InFlight
	// VM-wide, temporary refusals: retry the VM later, fail no volume.
	case has("migration is in progress"), has("until snapshot"), has("VMI is not running"):
		r = hotplug.Failed
	// Optimistic concurrency: a JSON-patch test failed or the object moved.
	case has("the server rejected our request due to an error in our request"),
		apierrors.IsConflict(err) && !has("Unable to"):
		r = hotplug.Conflict
	case apierrors.IsNotFound(err):
		r = hotplug.VMGone
	// The CRD schema's limit on a VM's disks and volumes, as the API server
	// words it (apimachinery field.TooMany): this volume cannot be added.
	case apierrors.IsInvalid(err) && has("Too many") && (has(".disks") || has(".volumes")):
		return hotplug.Outcome{Result: hotplug.Rejected, Err: fmt.Errorf("%w: %w", hotplug.ErrVMFull, err)}
	// Refusals of this one volume.
	case has("is not hotpluggable"),
		has("Unable to add volume source"),
		has("denied the request"),
		has("requires disk bus"),
		apierrors.IsInvalid(err), apierrors.IsBadRequest(err) && !has("feature gate"):
		r = hotplug.Rejected
	default:
		r = hotplug.Failed
	}
	return hotplug.Outcome{Result: r, Err: err}
}
