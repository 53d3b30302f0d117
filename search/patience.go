package search

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/cenkalti/backoff/v5"
)

// patiently sends a request until the engine answers it: a transport
// failure (refused, reset, no answer within the client's timeout) or an
// overloaded engine (429, 502, 503, 504) is an outage, waited out with
// backoff until ctx ends; any other answer, good or bad, is returned.
//
// Sending a request again is safe for what fanout sends: documents carry
// external versions, refreshes and alias swaps are idempotent. Index
// creation and deletion are not, so a retry that finds its work already
// done (the index exists, or is gone) after an attempt whose fate is
// unknown counts as done.
func (c *Client) patiently(ctx context.Context, method, path string, body []byte, contentType string, out any) error {
	unknown := false
	var last error
	op := func() (struct{}, error) {
		err := c.once(ctx, method, path, body, contentType, out)
		last = err
		switch {
		case err == nil:
			return struct{}{}, nil
		case ctx.Err() != nil:
			return struct{}{}, backoff.Permanent(err)
		case unknown && alreadyDone(method, err):
			return struct{}{}, nil
		case outage(err):
			unknown = true
			return struct{}{}, err
		}
		return struct{}{}, backoff.Permanent(err)
	}
	_, err := backoff.Retry(ctx, op,
		backoff.WithBackOff(&backoff.ExponentialBackOff{
			InitialInterval: 250 * time.Millisecond, RandomizationFactor: 0.3, Multiplier: 2, MaxInterval: 15 * time.Second,
		}),
		backoff.WithMaxElapsedTime(0),
		backoff.WithNotify(c.onOutage))
	if err != nil && last != nil && !errors.Is(err, last) {
		return fmt.Errorf("%w (the engine's last failure: %v)", err, last)
	}
	return err
}

// outage reports whether err says the engine could not answer rather than
// that it refused the request.
func outage(err error) bool {
	var e *Error
	if !errors.As(err, &e) {
		return true // no answer at all
	}
	switch e.Status {
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// alreadyDone reports whether err is what a creation or deletion answers
// when an earlier attempt of it succeeded.
func alreadyDone(method string, err error) bool {
	var e *Error
	if !errors.As(err, &e) {
		return false
	}
	switch method {
	case http.MethodPut:
		return e.Type == "resource_already_exists_exception"
	case http.MethodDelete:
		return e.Status == http.StatusNotFound
	}
	return false
}
