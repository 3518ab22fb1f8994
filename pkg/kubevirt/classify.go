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
	// Harvester's VM validator refuses every write of a VM while a claim of
	// its template is in another VM's template (harvester v1.6.0
	// pkg/webhook/resources/virtualmachine/validator.go:464-481, v1.7.0
	// :517-539), judged from its informer cache: right after an RWO volume
	// left the old VM the cache can still show it there, and the claim named
	// need not be one this write adds. The next attempt's live read of the
	// holders (pkg/hotplug fencing) answers a volume that is really held.
	case has("migration is in progress"), has("until snapshot"), has("VMI is not running"),
		has("denied the request") && harvesterOccupied(msg):
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

// harvesterOccupied reports Harvester's refusal of a claim another VM's
// template names, in the words of each release ("the volume %s is already
// used by VM %s/%s" up to 1.6; "PVC %s/%s is already used by other VM,
// please use a shareable RWX volume." from 1.7).
func harvesterOccupied(msg string) bool {
	return strings.Contains(msg, "is already used by VM ") || strings.Contains(msg, "is already used by other VM")
}
